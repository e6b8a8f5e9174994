"""The Ultra-Scale Playbook's best configurations as data: new data the planner never
saw when it was built, predicted blind first (benchmarks/RESULTS.md keeps that prediction beside
the later ones; benchmarks/playbook.py writes it).

Source: huggingface/nanotron, docs/benchmark_summary.svg (added in c2528430, 2025-03-10, "the best
configurations we discovered for each model size and node count in nanotron v0.5", README.md):
for each model and node count (8 H100 80GB SXM per node), dp/tp/pp, gradient accumulation g,
micro-batch m and ZeRO stage, with the measured MFU (%) and peak memory (GB). The numbers are the
figure's own labels, transcribed by hand.

The models, from scripts/scaling_benchmarks.py at 0e0a27ea (model_configs and create_config):
Llama blocks (SwiGLU, RMSNorm, RoPE) at seq 4096, vocab 131072, kv heads = heads (the script's
NUM_KEY_VALUE_HEADS is None: no GQA), the embeddings tied below ffn 10,000 (1.34B and 3.57B):
(layers, hidden, heads, ffn) = 1.34B (16, 2048, 32, 8192), 3.57B (28, 3072, 32, 8192), 8.86B (32,
4096, 32, 14336), 80B (80, 8192, 64, 28672); each gives the figure's parameter count (a test
checks). Training: bf16 with fp32 gradient accumulation (accumulate_grad_in_fp32), tp_mode
REDUCE_SCATTER (sequence parallelism) with asynchronous TP communication, 1F1B pipelines
(examples/config_tiny_llama.yaml), no activation recomputation, no context parallelism.

How the Playbook measured, and how it is compared here:
  MFU     nanotron's model FLOPs (src/nanotron/models/llama.py get_flops at 2411b022: the q/k/v,
          output and SwiGLU products, the attention products counted whole, not halved for the
          causal mask, and the LM head, x3 for forward and backward) per GPU per second over the
          H100 SXM's dense bf16 peak, 989 TFLOP/s (the datasheet; the figure's MFU is the CSV's
          mTFLOPs over a peak the repository does not state: an assumption). For these models that
          count is PaLM's 6N + 12·L·h·s (ops.model_flops_per_token) less the norms' weights (4e-5 of
          it), so the MFU error is the tokens/s error; published tokens/s/GPU = MFU · 989e12 / FLOPs per token.
  memory  nanotron logs both torch.cuda.max_memory_allocated and max_memory_reserved in GiB
          (helpers.py create_table_log, 'Mem Alloc (GB)' and 'Mem Res (GB)'); the figure does not
          say which it shows. Compared as max_memory_allocated (chosen before any prediction was
          made: the first of the two columns); the reserved comparison is printed beside it.
Assumptions named: the cluster's inter-node fabric is priced as the h100 profile's (400 Gb/s per
GPU; Hugging Face's cluster is AWS p5, EFA 3,200 Gb/s per 8-GPU node: the same per GPU); nanotron
splits an uneven pipeline by its blocks' compute cost, priced here as Llama 3's uneven stages
(search.stage_split); tp = 16 and 32 span nodes and are priced on the inter-node link.
"""

from __future__ import annotations

import dataclasses

from labkit.theory.planner.published import Run
from labkit.theory.planner.search import plan, stage_split

SOURCE = "huggingface/nanotron docs/benchmark_summary.svg (c2528430), nanotron v0.5 on 8xH100 nodes"
PEAK = 989e12
"""The H100 SXM's dense bf16 FLOP/s (NVIDIA's datasheet), the MFU's denominator assumed."""
SEQ, VOCAB = 4096, 131072
MODELS = {  # name: (layers, hidden, heads, ffn, params the figure gives, in billions)
    "1.34B": (16, 2048, 32, 8192, 1.34),
    "3.57B": (28, 3072, 32, 8192, 3.57),
    "8.86B": (32, 4096, 32, 14336, 8.86),
    "80B": (80, 8192, 64, 28672, 80.0),
}
# nodes: one cell per model, "dp/tp/pp g m Z -> MFU %, GB" as the figure labels it ('-': no cell)
CELLS = """
64 | 128/2/2 1 2 1 5.25 8.40  | 128/4/1 1 2 1 10.49 16.42 | 128/4/1 1 2 0 18.69 57.76 | 32/16/1 4 2 1 17.79 53.46
32 | 64/4/1 1 4 0 23.20 19.57 | 64/4/1 1 4 0 26.77 38.98  | 32/8/1 1 8 0 32.71 63.39  | 4/4/16 64 1 1 30.75 64.21
16 | 64/2/1 1 4 0 29.46 38.84 | 32/4/1 1 8 0 34.59 66.20  | 16/8/1 2 8 0 36.33 66.88  | 1/4/32 256 1 0 34.29 61.18
8  | 32/1/2 8 1 1 32.47 16.27 | 32/1/2 8 1 1 35.53 36.73  | 32/1/2 8 1 1 39.50 59.09  | 1/4/16 256 1 0 30.65 63.07
4  | 16/1/2 16 1 1 38.38 16.39 | 16/1/2 8 2 1 40.39 53.33 | 16/1/2 16 1 1 43.31 61.10 | 1/8/4 256 1 0 14.76 65.97
2  | 8/1/2 32 1 1 41.59 19.45 | 8/1/2 16 2 1 43.77 54.31  | 4/4/1 16 4 1 43.94 58.34  | -
1  | 4/1/2 16 4 1 44.32 41.76 | 4/1/2 32 2 1 46.68 56.87  | 2/1/4 128 1 1 45.22 63.07 | -
"""


def model(name: str) -> dict:
    """ModelConfig fields of one of the four models (scripts/scaling_benchmarks.py)."""
    layers, hidden, heads, ffn, _ = MODELS[name]
    return dict(
        arch="llama",
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        ffn=ffn,
        vocab=VOCAB,
        seq=SEQ,
        tie_embeddings=ffn < 10_000,  # the script ties below 4B (intermediate_size < 10,000)
    )


def nanotron_flops_per_token(m: dict) -> float:
    """nanotron's model FLOPs per token (llama.py get_flops, batch 1, over the sequence)."""
    h, heads, kv, f, s, L, V = m["hidden"], m["heads"], m["kv_heads"], m["ffn"], m["seq"], m["layers"], m["vocab"]
    d = h // heads
    qkv = 2 * h * heads * d + 2 * h * 2 * kv * d
    # q·k and the weights times v, each over the whole s x s square
    attention = 2 * heads * d * s + 2 * heads * s * d
    out = 2 * heads * d * h
    ffn = 4 * h * f + 2 * f * h
    return 3 * (L * (qkv + attention + out + ffn) + 2 * h * V)


def layout(dp: int, tp: int, pp: int, g: int, m: int, zero: int, layers: int) -> dict:
    """ParallelConfig fields of one cell: g microbatches of m sequences per data rank, SP with tp."""
    out = dict(
        dp=dp,
        tp=tp,
        pp=pp,
        microbatches=g,
        global_batch=dp * g * m,
        sharding="zero1" if zero else "none",
        sequence_parallel=tp > 1,
        precision="bf16",
        checkpoint_activations=False,
        schedule="1f1b",
    )
    split = stage_split(layers, pp) if pp > 1 else ()
    return dict(out, stage_layers=split) if split else out


def _cells() -> list[Run]:
    out = []
    names = list(MODELS)
    for line in CELLS.strip().splitlines():
        nodes, *cells = (c.strip() for c in line.split("|"))
        for name, cell in zip(names, cells):
            if cell == "-":
                continue
            mesh, g, m, zero, mfu, gb = cell.split()
            dp, tp, pp = (int(x) for x in mesh.split("/"))
            md = model(name)
            lay = layout(dp, tp, pp, int(g), int(m), int(zero), md["layers"])
            tps = float(mfu) / 100 * PEAK / nanotron_flops_per_token(md)
            run_name = f"Playbook {name}, {nodes} nodes, {mesh} g{g} m{m} Z{zero}"
            # memory: the figure's GB are nanotron's GiB (/1024**3), compared as allocated (the docstring)
            run = Run(run_name, SOURCE, md, lay, "h100", tps, float(gb), float(mfu) / 100, notes="nanotron v0.5")
            out.append(dataclasses.replace(run, family="playbook", memory_stat="allocated"))
    return out


PLAYBOOK: list[Run] = _cells()
"""The 26 cells, 64 nodes first, each model left to right."""


SWEEP = {"cp": 1, "ep": 1, "checkpoint_activations": False, "schedule": "1f1b"}
"""What the Playbook's sweep held (scripts/scaling_benchmarks.py): no cp, no experts, no recomputation, 1F1B."""
TOP = 5


def _same(a, b) -> bool:
    """The same layout as the sweep names one: mesh, ZeRO stage, accumulation (the micro-batch follows)."""
    return all(getattr(a, k) == getattr(b, k) for k in ("dp", "tp", "pp", "microbatches", "sharding"))


def sweep_plans(run: Run) -> list:
    """The planner's best over the sweep's space: tp over 1..32 (the sweep's, beyond a node), ZeRO 0 and 1."""
    model, gpus = run.model_config, run.config.world
    found = []
    for tp in (1, 2, 4, 8, 16, 32):
        if gpus % tp or model.heads % tp:
            continue
        for sharding in ("none", "zero1"):
            fixed = dict(SWEEP, tp=tp, sharding=sharding)
            found += plan(model, gpus, "h100", run.config.global_batch, TOP, "bf16", fixed, run.stack)
    return sorted(found, key=lambda p: (p.tight, -p.tokens_per_second_per_gpu))[:TOP]


def place(run: Run, priced, plans) -> tuple[int | None, float]:
    """(1-based place of the run's layout among `plans`, or None; its predicted speed over the best's).
    `priced`: the run's own layout as theory.evaluate prices it."""
    where = next((i + 1 for i, p in enumerate(plans) if _same(p.config, run.config)), None)
    best = max([priced.tokens_per_second_per_gpu] + [p.tokens_per_second_per_gpu for p in plans])
    return where, priced.tokens_per_second_per_gpu / best


def found(run: Run, priced, plans) -> bool:
    """The issue's test: the Playbook's layout among the planner's best TOP, or within 10% of its best."""
    where, ratio = place(run, priced, plans)
    return where is not None or ratio >= 0.9
