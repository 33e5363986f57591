#!/usr/bin/env bash
# Build the Linux bundle: dist/moedesk/ (a folder with `moedesk` and `moedesk-worker`) and
# dist/moedesk-linux-x86_64.tar.gz. Run from a checkout after `make install` (or let `make bundle` do it).
# `--no-tarball` skips the tarball (the bundle test needs only the folder; compressing takes minutes).
#
# The bundle carries the torch of the environment it is built in: built where torch is the CPU build,
# it runs the CPU reference engine only (see README, Packaging, for the GPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

"$PY" -c "import PyInstaller" 2>/dev/null || {
  echo "PyInstaller is missing: pip install -e '.[bundle]' (or run make bundle)" >&2; exit 2; }

# Ship the imported demo model so the bundle needs neither transformers nor the GGUF package.
# MOEDESK_BUNDLE_DEMO may name the folder; by default it is the demo in the models folder.
DEMO_DIR=${MOEDESK_BUNDLE_DEMO:-$("$PY" -c "from runtime import paths; print(paths.resolve_model(paths.DEMO_ALIAS))")}
[ -f "$DEMO_DIR/config.json" ] || "$PY" -m runtime.cli import-demo
[ -f "$DEMO_DIR/config.json" ] || { echo "no imported demo model at $DEMO_DIR" >&2; exit 2; }

MOEDESK_BUNDLE_DEMO="$DEMO_DIR" "$PY" -m PyInstaller --noconfirm --log-level WARN \
  --distpath dist --workpath build/pyinstaller packaging/moedesk.spec

if [ "${1:-}" = "--no-tarball" ]; then
  du -sh dist/moedesk
else
  rm -f dist/moedesk-linux-x86_64.tar.gz
  tar -C dist -czf dist/moedesk-linux-x86_64.tar.gz moedesk
  du -sh dist/moedesk dist/moedesk-linux-x86_64.tar.gz
fi
echo "Bundle ready: dist/moedesk/moedesk (install the menu entry with: dist/moedesk/moedesk --install-desktop-entry)"
