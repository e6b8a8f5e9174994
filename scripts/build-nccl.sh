#!/usr/bin/env bash
# Build an NCCL that runs several ranks on one GPU (>= 2.30) for one GPU architecture, on a machine
# without a GPU or a CUDA toolkit: nvcc and the CUDA headers come from NVIDIA's pip wheels. The
# result, .nccl/libnccl.so.2.xz, is what scripts/gpu-check.sh puts in front of torch's own NCCL
# (LD_PRELOAD) on a lent GPU machine whose torch ships an older one.
#
#   scripts/build-nccl.sh [tag] [sm]     # default v2.30.7-1 and 90 (H100, H200)
#
# Why build: the nvidia-nccl-cu13 wheel is 252 MB (libnccl.so.2 alone 299 MB: every architecture's
# kernels), more than one device call carries (64 MiB); one architecture's kernels are about a
# tenth of it. Measured on the 2-core CI-like machine: ~30 minutes; the source comes from
# github.com/NVIDIA/nccl (a local clone in NCCL_SRC, or fetched).
set -euo pipefail
TAG=${1:-v2.30.7-1}
SM=${2:-90}
CUDA_PIP=${CUDA_PIP:-13.0}  # the toolkit matching the GPU machine's driver (580: CUDA 13.0)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/nccl-build}
mkdir -p "$WORK/whl" "$WORK/cuda"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK/whl" \
    "nvidia-cuda-nvcc==$CUDA_PIP.*" "nvidia-cuda-runtime==$CUDA_PIP.*" "nvidia-cuda-cccl==$CUDA_PIP.*" \
    "nvidia-nvvm==$CUDA_PIP.*" "nvidia-cuda-crt==$CUDA_PIP.*"
for w in "$WORK"/whl/*.whl; do python3 -m zipfile -e "$w" "$WORK/cuda"; done
CUDA_HOME="$WORK/cuda/nvidia/cu13"
chmod +x "$CUDA_HOME"/bin/* "$CUDA_HOME"/nvvm/bin/*
ln -sfn lib "$CUDA_HOME/lib64"  # NCCL's makefiles look in lib64
if [ -z "${NCCL_SRC:-}" ]; then
    NCCL_SRC="$WORK/src"
    [ -d "$NCCL_SRC" ] || git clone --depth 1 --branch "$TAG" https://github.com/NVIDIA/nccl "$NCCL_SRC"
fi
make -C "$NCCL_SRC" -j"$(nproc)" src.build CUDA_HOME="$CUDA_HOME" \
    NVCC_GENCODE="-gencode=arch=compute_$SM,code=sm_$SM"
mkdir -p "$ROOT/.nccl"
lib=$(readlink -f "$NCCL_SRC/build/lib/libnccl.so.2")
strip --strip-unneeded -o "$WORK/libnccl.so.2" "$lib"
xz -T0 -6 -c "$WORK/libnccl.so.2" >"$ROOT/.nccl/libnccl.so.2.xz"
ls -la "$ROOT/.nccl"
