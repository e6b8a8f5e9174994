"""scripts/gpu-check.sh without a GPU: its dry run parses every stage's arguments and writes
every stage's file, the deadline skips what no longer fits and names it for the second call, and the
pieces that read a run's files (benchmarks/gpu_summary.py, gpu_planner.py --merge) do what they say.
A GPU run itself cannot be checked here: what it left is in the stages' files it brings back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["nccl", "faults", "pytest", "mfu", "pairs", "workspace", "memory", "ep", "planner", "fp8", "gloo"]


def _run(tmp_path, **env) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PARTS": str(tmp_path / "parts"),
        "PYTHON": sys.executable,
        **env,
    }
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu-check.sh"), "--dry-run"], env=env, capture_output=True, text=True
    )


def _stages(tmp_path) -> list[dict]:
    with open(tmp_path / "out" / "stages.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # thirteen Python processes, two of them pytest collecting: 20-40 s on two cores
def test_the_dry_run_runs_every_stage_and_brings_back_its_files(tmp_path):
    got = _run(tmp_path)
    assert got.returncode == 0, got.stdout[-3000:]
    assert [(s["stage"], s["rc"]) for s in _stages(tmp_path)] == [(s, 0) for s in STAGES]
    out = sorted(os.listdir(tmp_path / "out"))
    assert out == ["log.txt", "results.tgz", "stages.jsonl", "summary.txt"]  # 4 of the 8 files a call brings back
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        files = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
        frames = {n: json.load(tar.extractfile(m)) for n, m in files.items() if n.endswith(".json")}
    want = {"nccl", "faults", "mfu", "pairs", "workspace", "memory", "ep", "planner", "fp8", "fp8_llama"}
    assert set(frames) == {f"{n}.json" for n in want} and all(f["dry_run"] for f in frames.values())
    assert {"pytest.xml", "pytest_gloo.xml"} <= set(files)
    # a frame is no measurement: every item is said not to have run, none shows a number
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.count("not run") >= 8 and "rerun" not in got.stdout


def test_stages_past_the_deadline_are_skipped_and_named_for_the_second_call(tmp_path):
    got = _run(tmp_path, DEADLINE="0", STAGES="nccl fp8 gloo")
    assert got.returncode == 0
    assert _stages(tmp_path) == [{"stage": s, "skipped": True} for s in ("nccl", "fp8", "gloo")]
    assert 'rerun at once:  STAGES="nccl fp8 gloo" scripts/gpu-check.sh' in got.stdout


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("gpu_summary"), bench_script("gpu_planner")


def test_the_summary_holds_each_item_to_its_target(tmp_path, bench):
    summary, _ = bench
    row = lambda what, model, step, mfu: {
        "what": what,
        "model": model,
        "step_s": step,
        "mfu": mfu,
        "tokens_per_s": 1 / step,
    }
    mfu = {"rows": [row("lab compiled", "gpt2-124m", 0.0412, 0.44), row("one compiled", "gpt2-124m", 0.0400, 0.45)]}
    llama = {"rows": [row("lab eager", "llama3.2-1b", 0.34, 0.5), row("lab eager fp8", "llama3.2-1b", 0.25, 0.3)]}
    pairs = {"pairs": [{"layout": "tp", "lab": 0.5, "torch": 0.49, "ours_over_torch": 0.5 / 0.49}]}
    for name, doc in (("mfu.json", mfu), ("fp8_llama.json", llama), ("pairs.json", pairs)):
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "faults.json").write_text('{"faults": [{"what": "skipped colle')  # cut mid-write
    text = "\n".join(summary.lines(summary.read(str(tmp_path))))
    assert "5 lab compiled gpt2-124m: MFU 44.0% (target 40%)" in text
    assert "5 Lab over the plain loop, compiled gpt2-124m: 1.030 (target <= 1.03)" in text
    assert "5 ours / PyTorch's tp: 1.020 (target <= 1.02)" in text
    assert "7 Llama 3.2 1B tokens/s fp8 over bf16: 1.36 (target >= 1.3)" in text
    assert "2 faults and interrupts: not run" in text and "1 the log's NCCL end: not run" in text


def test_planner_points_merge_unless_one_is_a_row_the_planner_is_judged_on(tmp_path, bench):
    from labkit.theory.planner import audit
    from labkit.theory.presets import PRESETS

    _, planner = bench
    data = tmp_path / "planner_measurements.json"
    data.write_text(json.dumps({"eager_pace": [], "fsdp_step": [], "nccl": []}))
    point = {"device": "NVIDIA H100 80GB HBM3", "stack": "eager", "model": "gpt2-124m", "batch": 16, "seq": 1024}
    point |= {"kernel_bytes": 1.5e8, "memory_slowdown": 2.4, "source": "test", "step_s": 0.08}
    got = tmp_path / "planner.json"
    got.write_text(json.dumps({"eager_pace": [point], "fsdp_step": [], "nccl": [{"error": "timed out"}]}))
    assert planner.merge(str(got), str(data)) == []
    kept = json.loads(data.read_text())
    assert kept["eager_pace"] == [{k: v for k, v in point.items() if k != "step_s"}] and kept["nccl"] == []
    # a step the planner is judged on, as a point: refused, and the file left as it was
    presets = {(m.layers, m.hidden, m.vocab): name for name, m in PRESETS.items()}
    run = next(r for r in audit.ALL if (r.model_config.layers, r.model_config.hidden, r.model_config.vocab) in presets)
    m = run.model_config
    judged = dict(point, model=presets[(m.layers, m.hidden, m.vocab)], seq=m.seq)
    judged["batch"] = run.config.global_batch // run.config.dp
    got.write_text(json.dumps({"eager_pace": [judged]}))
    assert "calibration rows never become validation rows" in " ".join(planner.merge(str(got), str(data)))
    assert json.loads(data.read_text()) == kept


def test_the_planners_pace_steps_file_under_three_kernel_sizes_and_fsdp_has_copies(bench):
    from labkit.theory.planner import stacks
    from labkit.theory.planner.hardware import H100

    _, planner = bench
    rows = [{"model": m, "batch": b, "seq": s, **({"layers": n} if n else {})} for m, b, s, n in planner.PACE_STEPS]
    sizes = [stacks.kernel_bytes(r) for r in rows]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3  # else measured.pace_points would see one pace
    name, batch, seq = planner.FSDP_STEP
    assert stacks.fsdp_copy_seconds({"model": name, "batch": batch, "seq": seq, "world": 1}, H100) > 0
