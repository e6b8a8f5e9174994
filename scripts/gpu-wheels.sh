#!/usr/bin/env bash
# The Python packages a lent GPU machine lacks, as wheels in .whl/ for scripts/gpu-check.sh to install
# there (its image has torch, numpy, pandas, cloudpickle, psutil, pytest, pytest-timeout, six and
# typing_extensions: /work/.library/device/KINDS.md; nothing can be fetched on it).
#
#   scripts/gpu-wheels.sh        # on a machine with pip and a registry; writes .whl/ (about 15 MB)
#
# What `from labkit import Lab` and an ipyparallel engine import beyond the image, read off
# sys.modules on the CPU machine (2026-11-28), at the versions its venv runs; torchao for
# precision="fp8" (the [fp8] extra's pin). The machine runs Python 3.12 on x86-64: the binary wheels
# (pyzmq, debugpy, torchao) are fetched for that, whatever runs this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS=(
    ipyparallel==9.2.0 ipykernel==7.4.0 ipython==8.12.3 jupyter_client==8.10.0 jupyter_core==5.9.1
    pyzmq==27.3.0 tornado==6.6.1 traitlets==5.15.0 comm==0.2.3 debugpy==1.8.22 matplotlib-inline==0.2.2
    nest-asyncio==1.6.0 jedi==0.20.0 parso==0.8.7 pexpect==4.8.0 ptyprocess==0.7.0 prompt_toolkit==3.0.52
    wcwidth==0.7.0 stack-data==0.6.3 executing==2.2.1 asttokens==3.0.1 pure_eval==0.2.3 decorator==5.2.1
    platformdirs==4.14.8 backcall==0.2.0 pickleshare==0.7.5 torchao==0.18.0
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${PKGS[@]}"
du -sh .whl
