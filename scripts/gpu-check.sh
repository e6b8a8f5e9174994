#!/usr/bin/env bash
# The GPU check, one call on a lent GPU machine (34, 45): bring an NCCL that runs two ranks on
# one GPU, then run the stages most important first, each bounded, all of them within DEADLINE seconds
# (540: one call is 600 s at most, and a second call must still fit the 15 minutes of device time):
#
#   stage      bound  item                      what
#   nccl         60   1  the log's NCCL end     two NCCL ranks on the GPU without labkit, and the collective
#                                               log on a blocking all-reduce: a PASS/FAIL verdict per rank
#   faults      110   2  NCCL faults            skipped all-reduce, raising rank, killed engine, each then the
#                     (46 the stop)             next layout; cancel and Ctrl-C under DDP and 1F1B
#   pytest      110   1, done-when              pytest -m gpu on NCCL (the flight-recorder test is item 1's)
#   mfu         170   5  compiled MFU           Lab and plain loop compiled, GPT-2 124M then Llama 3.2 1B
#   pairs       100   5  ours / PyTorch's       DDP, FSDP, 1F1B, TP at world 2 (and a Perfetto trace)
#   workspace    45   3  the allocator's const  cuBLAS's workspaces, measured (benchmarks/gpu_workspace.py)
#   memory       45   3  its check              the one-GPU peak against the theory, less the workspaces
#   ep           40   4  EP in bf16             the EP layouts at world 2 on NCCL
#   planner     100   6  planner measurements   eager pace at 3 kernel sizes, an FSDP step, NCCL latency
#   fp8         120   7  FP8                    fp8 layouts at world 2; Llama 3.2 1B tokens/s fp8 vs bf16
#   gloo        110   done-when                 pytest -m gpu's gloo-on-CUDA tests (passed on the H100)
#
# Measured before (H100, 2026-11-26): nccl 17 s, 39 layouts 197 s, pytest 122 s, mfu past 240 s. A stage
# that no longer fits before the deadline is skipped; one cut at its bound is kept as far as it got; the
# last lines say which to run in a second call at once (the machine stays warm 30 s):
#   STAGES="fp8 gloo" scripts/gpu-check.sh
# What comes back ($OUT, 8 files at most): log.txt, stages.jsonl, summary.txt and results.tgz (every
# stage's files, repacked after each stage; benchmarks/gpu_summary.py reads it).
#
#   scripts/gpu-check.sh              # OUT defaults to ./gpu-out
#   scripts/gpu-check.sh --dry-run    # any machine, no GPU: every stage's arguments and files (CI's check)
#
# Wheels the GPU image lacks come in .whl/ (scripts/gpu-wheels.sh), the NCCL in .nccl/libnccl.so.2.xz
# (scripts/build-nccl.sh); both optional where the machine has them. Carry both: 17 + 29 MB of 64.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-$PWD/gpu-out}
PARTS=${PARTS:-/tmp/gpu-check-parts}
mkdir -p "$OUT" "$PARTS"
exec > >(tee -a "$OUT/log.txt") 2>&1
STAGES=${STAGES:-"nccl faults pytest mfu pairs workspace memory ep planner fp8 gloo"}
DEADLINE=${DEADLINE:-540}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
T0=$SECONDS
RERUN=""

pack() { # every stage's files into one archive, replaced whole (a call cut off keeps the last one)
    tar -czf "$OUT/.results.tgz" -C "$PARTS" . && mv "$OUT/.results.tgz" "$OUT/results.tgz"
}

stage() { # name bound command...: run bounded by the bound and the deadline, record rc and seconds
    local name=$1 limit=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    local left=$((DEADLINE - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, $left s left of the deadline" >&2
        echo "{\"stage\": \"$name\", \"skipped\": true}" >>"$OUT/stages.jsonl"
        RERUN="$RERUN $name"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (at most ${limit} s) $(date +%T)" >&2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - t0)) s" >&2
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >>"$OUT/stages.jsonl"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && RERUN="$RERUN $name" # cut at its bound: its files hold what it reached
    pack
}

# -- what this machine lacks ------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    D=--dry-run
    echo "dry run: no GPU, every stage's arguments and files"
else
    D=
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
fi
git log --oneline -1 2>/dev/null || true
B=benchmarks

# -- 1. the collective log on NCCL, and the settings that run two ranks on one GPU -----------------
: >"$PARTS/nccl_env.sh"
stage nccl 60 bash -c "$PY $B/nccl_shared.py --out $PARTS/nccl.json --limit 25 $D >$PARTS/nccl_env.sh"
cat "$PARTS/nccl_env.sh"
# shellcheck disable=SC1091
. "$PARTS/nccl_env.sh" # the settings that worked; the Lab forwards NCCL_* to its engines

# -- 2. faults and interrupts on NCCL ---------------------------------------------------------------
stage faults 110 $PY $B/gpu_faults.py --out "$PARTS/faults.json" $D

# -- the GPU tests on NCCL (the gloo-on-CUDA ones last) ---------------------------------------------
GLOO="gloo_on_cuda or sharing_a_gpu_on_gloo or torch_pipelining_on_shared"
PYTEST=($PY -m pytest -m gpu -v -rfEs -p no:cacheprovider --timeout 100 tests/test_gpu.py tests/test_gpu_classroom.py)
[ "$DRY" = 1 ] && PYTEST+=(--collect-only -q)
stage pytest 110 "${PYTEST[@]}" -k "not ($GLOO)" --junitxml="$PARTS/pytest.xml"

# -- 5. compiled MFU, the Lab against the plain loop, ours against PyTorch's ---------------------------
stage mfu 170 $PY $B/gpu_mfu.py --out "$PARTS/mfu.json" --parts lab one --kinds compiled --steps 6 \
    --models gpt2-124m llama3.2-1b $D # Lab GPT-2, Lab Llama, then the loop's: GPT-2 (the Lab-vs-loop pair), Llama
stage pairs 100 $PY $B/gpu_mfu.py --out "$PARTS/pairs.json" --parts pairs --steps 6 --trace "$PARTS/trace.json" $D

# -- 3. the allocator's constant, and the peak it explains ------------------------------------------
stage workspace 45 $PY $B/gpu_workspace.py --out "$PARTS/workspace.json" $D
WS=()
[ -f "$PARTS/workspace.json" ] && WS=(--workspace "$PARTS/workspace.json")
stage memory 45 $PY $B/gpu_layouts.py --only memory "${WS[@]}" --out "$PARTS/memory.json" $D

# -- 4. EP in bf16 ----------------------------------------------------------------------------------
stage ep 40 $PY $B/gpu_layouts.py --only layouts --layouts ep --out "$PARTS/ep.json" $D

# -- 6. the planner's measurements ------------------------------------------------------------------
stage planner 100 $PY $B/gpu_planner.py --out "$PARTS/planner.json" $D

# -- 7. FP8 -----------------------------------------------------------------------------------------
stage fp8 120 bash -c "$PY $B/gpu_fp8.py --out $PARTS/fp8.json $D && $PY $B/gpu_mfu.py --parts lab --kinds eager \
    --precisions bf16 fp8 --models llama3.2-1b --steps 6 --out $PARTS/fp8_llama.json $D"

# -- the gloo-on-CUDA tests -------------------------------------------------------------------------
stage gloo 110 "${PYTEST[@]}" -k "$GLOO" --junitxml="$PARTS/pytest_gloo.xml"

$PY $B/gpu_summary.py "$PARTS" | tee "$OUT/summary.txt"
[ -n "$RERUN" ] && echo "rerun at once:  STAGES=\"${RERUN# }\" scripts/gpu-check.sh"
echo "=== done in $((SECONDS - T0)) s"
