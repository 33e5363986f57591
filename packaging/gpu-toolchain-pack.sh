#!/usr/bin/env bash
# Pack NVIDIA's CUDA compiler wheels small enough to carry to an offline GPU machine for gpu-smoke.sh:
#
#   packaging/gpu-toolchain-pack.sh [CUDA_TOOLKIT_VERSION] [OUTDIR]     (defaults: 13.0.2, build/gpu-carry)
#
# CUDA_TOOLKIT_VERSION is the `cuda-toolkit` metapackage version that the target's torch pins (torch 2.11:
# 13.0.2; torch 2.13: 13.0.3; `pip show torch` lists it). The nvcc, crt, cccl and nvvm wheels it names weigh
# ~100 MB; this keeps only what compiling a CUDA extension uses (nvcc, cudafe++, ptxas, fatbinary, cicc,
# libdevice, the headers) and leaves out nvlink (device linking, unused without -rdc), libnvvm.so (NVRTC-style
# JIT), bin2c and the device query: one .tar.xz of ~36 MB with the wheels' own layout (nvidia/cu13/...),
# plus the CUDA runtime's headers and libcudart (~0.5 MB; the cuBLAS/cuSPARSE/cuSOLVER headers torch's own
# headers include come from the target's torch wheels). Also downloads ninja and PyInstaller
# (with its pure-Python dependencies) for Python 3.12 on x86-64 Linux. Needs the network.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-13.0.2}
OUTDIR=${2:-build/gpu-carry}
PY=${PYTHON:-python3}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$OUTDIR"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --python-version 3.12 --only-binary=:all:)

"$PY" -m pip download -q -d "$STAGE/whl" "${PLATFORM[@]}" "cuda-toolkit[nvcc,crt,cccl,nvvm,cudart]==$VERSION"
for w in "$STAGE"/whl/nvidia_*.whl; do
  "$PY" -m zipfile -e "$w" "$STAGE/tree"
done
CU=$(ls -d "$STAGE"/tree/nvidia/cu*)
rm -rf "$CU/.metadata" "$CU/bin/nvlink" "$CU/bin/__nvcc_device_query" "$CU/bin/bin2c" "$CU"/lib/libnvvm.so* \
  "$CU"/lib/*.a
chmod +x "$CU"/bin/* "$CU"/nvvm/bin/* 2>/dev/null || true
OUT="$OUTDIR/cuda-toolchain-$VERSION.tar.xz"
tar -C "$STAGE/tree" -cf - nvidia | xz -T0 -9 > "$OUT"

"$PY" -m pip download -q -d "$OUTDIR" "${PLATFORM[@]}" --no-deps ninja==1.13.2 pyinstaller==6.22.3 \
  pyinstaller-hooks-contrib==2026.9 altgraph==0.17.5
ls -l "$OUTDIR"
du -ch "$OUTDIR"/* | tail -1
