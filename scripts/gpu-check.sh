#!/usr/bin/env bash
# The GPU check, in one call on a lent GPU machine (issues 33 and 34): bring an NCCL that runs
# several ranks on one GPU, then — most important first, so a run cut off still says the most —
#   1. versions, and two NCCL ranks on the one GPU without labkit (benchmarks/nccl_shared.py)
#   2. every strategy family at world 2 on NCCL against the one-process reference, the faults on
#      NCCL, memory by category against the theory (benchmarks/gpu_layouts.py)
#   3. pytest -m gpu
#   4. MFU on one GPU, and ours against PyTorch's at world 2 (benchmarks/gpu_mfu.py)
#   5. the device's constants (benchmarks/gpu_constants.py)
# Measured on an H100 (2026-11-26): nccl 18 s, layouts 39 rows + memory + faults 197 s, pytest 122 s,
# constants 24 s; mfu ran past its 240 s before its compiled Llama (cold torch.compile), so the mfu
# stage now has 420 s and runs its compiled rows first. About 13 minutes in all, more than one call
# should hold: run it as two calls, the second within the machine's warm window (30 s) of the first,
# the one whose numbers are still missing first (issue 34's mfu):
#   STAGES="nccl mfu" scripts/gpu-check.sh;   STAGES="nccl layouts pytest constants" scripts/gpu-check.sh
# Each stage is bounded; the results land in $OUT (8 files at most come back from the device):
#   log.txt  stages.jsonl  nccl.json  layouts.json  pytest.xml  mfu.json  trace.json  gpu_constants.json
#
#   scripts/gpu-check.sh                       # OUT defaults to ./gpu-out
#   STAGES="nccl layouts" scripts/gpu-check.sh # only some stages
#
# Wheels the GPU image lacks (ipyparallel and its kin) come in .whl/, the NCCL in
# .nccl/libnccl.so.2.xz (built from NVIDIA/nccl for this GPU's architecture: scripts/build-nccl.sh);
# both are optional where the machine has them already.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
STAGES=${STAGES:-"nccl layouts pytest mfu constants"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

stage() { # name limit command...: run bounded, record rc and seconds
    local name=$1 limit=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name (at most ${limit} s) $(date +%T)" >&2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0)) s" >&2
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >>"$OUT/stages.jsonl"
}

# -- what this machine lacks ------------------------------------------------------------------
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
(cd /tmp && $PY -c "import labkit.engines" 2>/dev/null) || $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || $PY -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
if [ -f .nccl/libnccl.so.2.xz ]; then
    $PY -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'), open('/tmp/libnccl.so.2', 'wb'))"
    export LD_PRELOAD=/tmp/libnccl.so.2${LD_PRELOAD:+:$LD_PRELOAD}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch; from labkit.engines.host import nccl_version; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL built', torch.cuda.nccl.version(), 'NCCL run', nccl_version(), torch.cuda.get_device_name())"

# -- 1. NCCL with two ranks on one GPU, without labkit ------------------------------------------
: >/tmp/nccl_env.sh
stage nccl 90 $PY benchmarks/nccl_shared.py --out "$OUT/nccl.json" --limit 25 >/tmp/nccl_env.sh
cat /tmp/nccl_env.sh
# shellcheck disable=SC1091
. /tmp/nccl_env.sh # the settings that worked; the Lab forwards NCCL_* to its engines

# -- 2. the layouts at world 2 on NCCL ----------------------------------------------------------
# where no setting ran two NCCL ranks on the GPU, the same layouts on gloo still say something
BACKEND=auto
if [ -f "$OUT/nccl.json" ] && ! grep -q NCCL_MULTI_RANK_GPU_ENABLE /tmp/nccl_env.sh; then BACKEND=gloo; fi
stage layouts 240 $PY benchmarks/gpu_layouts.py --out "$OUT/layouts.json" --backend "$BACKEND"

# -- 3. the GPU tests ---------------------------------------------------------------------------
stage pytest 150 $PY -m pytest -m gpu -v -rfEs -p no:cacheprovider --timeout 120 --junitxml="$OUT/pytest.xml" \
    tests/test_gpu.py tests/test_gpu_classroom.py

# -- 4. MFU and ours against PyTorch's --------------------------------------------------------------
stage mfu 420 $PY benchmarks/gpu_mfu.py --out "$OUT/mfu.json" --trace "$OUT/trace.json"

# -- 5. the device's constants ------------------------------------------------------------------
stage constants 60 env OUT="$OUT" $PY benchmarks/gpu_constants.py

echo "=== done in $SECONDS s"
