#!/usr/bin/env bash
# Build the Linux bundle: dist/moedesk/ (a folder with `moedesk` and `moedesk-worker`) and
# dist/moedesk-linux-x86_64.tar.gz. Run from a checkout after `make install` (or let `make bundle` do it).
# `--no-tarball` skips the tarball (the bundle test needs only the folder; compressing takes minutes).
# `--gpu` builds the GPU bundle (make bundle-gpu): the environment's CUDA torch, and exllamav2's extension
# built here first for TORCH_CUDA_ARCH_LIST (default: Ampere to Blackwell, those this nvcc supports), so
# nothing is compiled on the user's machine; the tarball is dist/moedesk-linux-x86_64-cuda.tar.gz.
#
# The bundle carries the torch of the environment it is built in: built where torch is the CPU build,
# it runs the CPU reference engine only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
GPU=0 TARBALL=1
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    --no-tarball) TARBALL=0 ;;
    *) echo "unknown option $arg (use --gpu, --no-tarball)" >&2; exit 2 ;;
  esac
done
NAME=moedesk-linux-x86_64
if [ "$GPU" = 1 ]; then
  NAME=moedesk-linux-x86_64-cuda
  "$PY" -c "import torch, sys; sys.exit(torch.version.cuda is None)" || {
    echo "--gpu needs the CUDA build of torch in this environment" >&2; exit 2; }
  ARCHS=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "from runtime.gpu_setup import BUNDLE_ARCH_LIST; print(BUNDLE_ARCH_LIST)")}
  # setup-gpu --json ends with {"event": "done", "module": PATH} or {"event": "failed", ...}
  MODULE=$("$PY" -m runtime.cli setup-gpu --arch-list "$ARCHS" --json | "$PY" -c "
import json, sys
events = [json.loads(line) for line in sys.stdin if line.startswith('{')]
end = events[-1] if events else {}
print(end.get('module', ''))
if end.get('event') == 'failed':
    print(end['message'] + '\n' + end['detail'], file=sys.stderr)")
  export MOEDESK_BUNDLE_EXT=${MODULE:+$(dirname "$MODULE")}
  [ -n "$MOEDESK_BUNDLE_EXT" ] || { echo "the GPU kernels for $ARCHS did not build" >&2; exit 1; }
  echo "Shipping the GPU kernels from $MOEDESK_BUNDLE_EXT"
fi

"$PY" -c "import PyInstaller" 2>/dev/null || {
  echo "PyInstaller is missing: pip install -e '.[bundle]' (or run make bundle)" >&2; exit 2; }
# PyInstaller bundles what imports here: a GUI stack that does not import would give a bundle that
# cannot start, found only after minutes of analysis.
"$PY" -c "import PySide6.QtWidgets, qasync" 2>/dev/null || {
  echo "the GUI stack does not import here ($("$PY" -c "import PySide6.QtWidgets, qasync" 2>&1 | tail -1));" \
       "install the project (make install) before building the bundle" >&2; exit 2; }

# Ship the imported demo model so the bundle needs neither transformers nor the GGUF package.
# MOEDESK_BUNDLE_DEMO may name the folder; by default it is the demo in the models folder.
DEMO_DIR=${MOEDESK_BUNDLE_DEMO:-$("$PY" -c "from runtime import paths; print(paths.resolve_model(paths.DEMO_ALIAS))")}
[ -f "$DEMO_DIR/config.json" ] || "$PY" -m runtime.cli import-demo
[ -f "$DEMO_DIR/config.json" ] || { echo "no imported demo model at $DEMO_DIR" >&2; exit 2; }

MOEDESK_BUNDLE_DEMO="$DEMO_DIR" "$PY" -m PyInstaller --noconfirm --log-level WARN \
  --distpath dist --workpath build/pyinstaller packaging/moedesk.spec

if [ "$TARBALL" = 0 ]; then
  du -sh dist/moedesk
else
  rm -f "dist/$NAME.tar.gz"
  tar -C dist -czf "dist/$NAME.tar.gz" moedesk
  du -sh dist/moedesk "dist/$NAME.tar.gz"
fi
echo "Bundle ready: dist/moedesk/moedesk (install the menu entry with: dist/moedesk/moedesk --install-desktop-entry)"
