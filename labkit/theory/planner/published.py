"""Published training runs as data, each row with its source: what the planner's predictions are
held against (benchmarks/published.py prints predicted vs published for every row; the table of
errors is in benchmarks/RESULTS.md). Transcribed by hand from the files named below (the numbers
used, not the files).

torchtitan: pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md at commit
31a17bfdb70bab6f62a13d21816a5339b911d6e3 (runs of Dec 2024, torch 1963fc8, torchtitan 9dec370):
Llama 3.1 on H100 96GB HBM2e at 500 W (theory.hardware.H100_GRAND_TETON), seq 8192 unless the
table says; memory is torch.cuda.max_memory_reserved (torchtitan logs max_reserved, GiB); 'local
batch' is sequences per data-parallel rank; 'selective' is torchtitan's per-op policy ('op').
Pipelines: one microbatch per pipeline stage (torchtitan's default when
pipeline_parallel_microbatches is unset), two stages per rank for interleaved 1F1B; 126 layers
on 8 or 16 stages are split as torchtitan's split points do, evenly, the remainder on the middle.

llm-foundry: mosaicml/llm-foundry, scripts/train/benchmarking/README.md at commit
061f2c7ce64e655100286584a7629e2a09f827ba, tables "H100 80GB BF16" and "H100 80GB FP8" (MPT models,
torch 2.0.1 + CUDA 11.8 per sweep.sh, Composer FSDP FULL_SHARD, Triton flash attention). MPT is
GPT-2's architecture (biases, LayerNorm, learned positions, tied head) at vocab 50368 and the
widths of scripts/train/yamls/pretrain/mpt-*.yaml; theory.num_params equals the table's NumParams
for every row (a test checks). Its loss is flash-attn's fused cross-entropy (ModelConfig.loss
'fused': llm-foundry's ComposerMPTCausalLM takes loss_fn 'fused_crossentropy' unless told
otherwise, llmfoundry/models/mpt/modeling_mpt.py). No memory is published; every run ran, so each
layout fits (a test holds the planner to that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.choices import recomputation
from labkit.theory import presets

TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 31a17bf"
LLM_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 061f2c7"

LLAMA31_8B = presets.LLAMA31_8B.to_dict()
LLAMA31_70B = presets.LLAMA31_70B.to_dict()
LLAMA31_405B = presets.LLAMA31_405B.to_dict()

MPT = {  # (hidden, heads, layers): mpt-*.yaml, expansion_ratio 4
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}


@dataclass(frozen=True)
class Unpriced:
    """A term the model lacks, attached by hand to a row that uses it, with the measurement that
    shows the term is real (a file in this repository, or a source's own published numbers). It
    explains a miss; it never makes one a hit (theory/planner/audit.py counts every miss)."""

    term: str
    evidence: str
    """A path in this repository and what it measured, or 'published: ' and the source's numbers."""


@dataclass(frozen=True)
class Run:
    """One published training run."""

    name: str
    source: str
    model: dict
    """ModelConfig fields."""
    layout: dict
    """ParallelConfig fields (global_batch in sequences)."""
    hardware: str
    tokens_per_second_per_gpu: float
    memory_gib: float | None = None
    """Published memory per GPU, GiB (torchtitan: max reserved); None where none is published."""
    mfu: float | None = None
    params: int | None = None
    """The parameter count the source gives, where it gives one."""
    notes: str = ""
    """What the run used beyond the layout (torch.compile, AsyncTP, ...)."""
    unpriced: tuple[Unpriced, ...] = ()
    """Terms the model lacks that this run uses, each with its evidence (attached by hand)."""
    family: str = "torchtitan"
    """Which table the row comes from: 'torchtitan', 'llm-foundry', 'here', 'playbook'."""
    memory_stat: str = "reserved"
    """The source's memory statistic: 'reserved' (torch.cuda.max_memory_reserved) or 'allocated'."""
    stack: str = "eager"
    """The software stack it ran (theory/planner/stacks.py): 'compile' where the source used torch.compile."""

    @property
    def today(self) -> bool:
        """Run on today's software: every table but llm-foundry's, which ran torch 2.0.1 with CUDA 11.8 (2023)."""
        return self.family != "llm-foundry"

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(**self.layout)


OP_POLICY = Unpriced(
    "what torchtitan's per-op checkpointing policy costs beyond the recomputation priced here",
    "benchmarks/gpu_constants_h200.json: the Llama step with the per-op policy (its save list naming cuDNN's "
    "attention) took 0.226 s against 0.192 s without checkpointing (+18%), where the model prices +11% of "
    "recomputation",
)
ASYNC_TP = Unpriced(
    "AsyncTP's overlap of tensor parallelism's collectives with the matmuls",
    "published: torchtitan table 4, the same 70B layout 829 tokens/s/GPU without AsyncTP, 876 with it",
)


def _titan(name, model, tps, gib, notes="", unpriced=(), **layout) -> Run:
    # torch.compile is a stack the model prices by name (stacks.py), not a term it lacks
    stack = "compile" if "torch.compile" in notes else "eager"
    return Run(
        name, TORCHTITAN, model, layout, "h100-96gb", tps, gib, notes=notes, unpriced=tuple(unpriced), stack=stack
    )


def _torchtitan() -> list[Run]:
    b16 = dict(precision="bf16", sharding="fsdp", checkpoint_activations="op")
    fp8 = dict(precision="fp8", sharding="fsdp", checkpoint_activations=True)
    out = []
    for gpus, table in ((8, 1), (128, 3)):  # tables 1 and 3: FSDP, local batch 2, selective AC
        for tech, tps, gib in {
            8: (("FSDP", 5762, 82.4), ("FSDP + compile", 6667, 77.0), ("FSDP + compile + Float8", 8532, 76.8)),
            128: (("FSDP", 5605, 67.0), ("FSDP + compile", 6514, 62.0), ("FSDP + compile + Float8", 8380, 61.8)),
        }[gpus]:
            lay = dict(b16, dp=gpus, global_batch=2 * gpus, precision="fp8" if "Float8" in tech else "bf16")
            notes = "torch.compile" if "compile" in tech else ""
            # by hand: the eager rows run the per-op policy eagerly (the compiled ones: the compile stack)
            terms = () if "compile" in tech else (OP_POLICY,)
            out.append(_titan(f"T{table} 8B {tech}, {gpus} GPUs", LLAMA31_8B, tps, gib, notes, terms, **lay))
    for dp, cp, seq, tps, gib in (
        (8, 1, 32768, 3890, 83.9),
        (4, 2, 65536, 2540, 84.2),
        (2, 4, 131072, 1071, 84.0),
        (1, 8, 262144, 548, 84.5),
    ):
        model = dict(LLAMA31_8B, seq=seq)
        out.append(
            _titan(
                f"T2 8B FSDP {dp} CP {cp}, seq {seq}",
                model,
                tps,
                gib,
                "torch.compile",
                (),
                dp=dp,
                cp=cp,
                global_batch=dp,
                **fp8,
            )
        )
    for name, tps, gib, notes in (
        ("2D", 829, 71.9, "torch.compile"),
        ("2D + AsyncTP", 876, 67.6, "torch.compile; AsyncTP overlaps TP's collectives"),
    ):
        lay = dict(fp8, dp=32, tp=8, sequence_parallel=True, global_batch=512)
        terms = (ASYNC_TP,) if "AsyncTP" in name else ()
        out.append(_titan(f"T4 70B FSDP 32 TP 8 {name}", LLAMA31_70B, tps, gib, notes, terms, **lay))
    pipe = dict(fp8, dp=8, tp=8, pp=8, sequence_parallel=True, global_batch=256)
    asy = "torch.compile; AsyncTP"
    out.append(
        _titan(
            "T5 405B 1F1B",
            LLAMA31_405B,
            100,
            82.5,
            asy,
            (ASYNC_TP,),
            microbatches=8,
            stage_layers=(15, 16, 16, 16, 16, 16, 16, 15),
            **pipe,
        )
    )
    out.append(
        _titan(
            "T5 405B interleaved 1F1B",
            LLAMA31_405B,
            128,
            72.7,
            asy,
            (ASYNC_TP,),
            microbatches=16,
            schedule="interleaved",
            virtual_stages=2,
            stage_layers=(7,) + (8,) * 14 + (7,),
            **pipe,
        )
    )
    for dp, cp, seq, tps, gib in (
        (8, 1, 32768, 76, 75.3),
        (4, 2, 65536, 47, 75.9),
        (2, 4, 131072, 31, 77.1),
        (1, 8, 262144, 16, 84.9),
    ):
        lay = dict(
            fp8,
            dp=dp,
            cp=cp,
            tp=8,
            pp=8,
            sequence_parallel=True,
            global_batch=8 * dp,
            microbatches=8,
            stage_layers=(15, 16, 16, 16, 16, 16, 16, 15),
        )
        name = f"T6 405B FSDP {dp} CP {cp}, seq {seq}"
        out.append(_titan(name, dict(LLAMA31_405B, seq=seq), tps, gib, asy, (ASYNC_TP,), **lay))
    return out


# llm-foundry, table "H100 80GB BF16" then "H100 80GB FP8":
# model, seq, GPUs, MFU %, micro batch, grad accum, global batch, tokens/s/GPU, activation checkpointing,
# NumParams
FOUNDRY_BF16 = """
70b 2048 64 42.57 8 4 2048 1039 1 64862437376; 70b 2048 32 36.15 2 16 1024 882 1 64862437376
30b 8192 8 29.92 1 21 168 1384 1 30019254272; 30b 4096 8 35.86 1 21 168 1802 1 29989894144
30b 2048 32 43.92 14 3 1344 2308 1 29975214080; 30b 2048 16 43.07 10 3 480 2263 1 29975214080
30b 2048 8 38.11 3 21 504 2002 1 29975214080; 30b 1024 8 38.76 6 21 1008 2084 1 29967874048
13b 32768 8 31.68 1 3 24 1976 1 13011240960; 13b 16384 8 35.55 3 3 72 2985 1 12927354880
13b 4096 8 41.6 10 3 240 4717 1 12864440320; 13b 2048 64 39.86 2 1 128 4800 0 12853954560
13b 2048 32 39.95 2 1 64 4811 0 12853954560; 13b 2048 16 39.58 2 1 32 4767 0 12853954560
13b 2048 8 39.79 2 1 16 4792 0 12853954560; 13b 1024 8 44.27 40 3 960 5502 1 12848711680
7b 65536 8 28.59 1 2 16 1956 1 6918905856; 7b 32768 8 30.94 2 2 32 3318 1 6784688128
7b 8192 8 37.14 8 2 128 6935 1 6684024832; 7b 4096 8 40.42 16 2 256 8611 1 6667247616
7b 2048 8 46.44 6 1 48 10643 0 6658859008; 7b 1024 8 42.83 64 2 1024 10203 1 6654664704
3b 65536 8 26.81 1 2 16 3262 1 2814366720; 3b 32768 8 28.84 3 6 144 5873 1 2730480640
3b 16384 8 36.34 1 6 48 11152 0 2688537600; 3b 8192 8 40.31 3 6 144 16578 0 2667566080
3b 4096 8 42.31 5 6 240 20964 0 2657080320; 3b 2048 64 40.8 6 3 1152 22525 0 2651837440
3b 2048 32 41.7 6 3 576 23021 0 2651837440; 3b 2048 16 43.73 10 3 480 24142 0 2651837440
3b 1024 8 46.2 20 6 960 27046 0 2649216000; 3b 512 8 46.32 40 6 1920 27965 0 2647905280
1b 65536 8 26.34 1 2 16 5506 1 1445974016; 1b 32768 8 33.54 1 4 32 12025 0 1378865152
1b 16384 8 35.22 2 4 64 19649 0 1345310720; 1b 8192 8 37.73 3 4 96 29157 0 1328533504
1b 4096 8 40.26 7 4 224 38535 0 1320144896; 1b 2048 64 40.85 20 1 1280 44402 0 1315950592
1b 2048 32 41.52 20 1 640 45130 0 1315950592; 1b 2048 16 42.36 20 1 320 46037 0 1315950592
1b 2048 8 41.82 14 1 112 45455 0 1315950592; 1b 1024 8 41.95 18 4 576 48910 0 1313853440
1b 512 8 43.21 56 4 1792 52275 0 1312804864; 760m 32768 8 31.84 1 2 16 16291 0 807656448
760m 16384 8 33.57 3 2 48 27815 0 782490624; 760m 8192 8 34.84 6 2 96 41825 0 769907712
760m 4096 8 35.83 12 2 192 55459 0 763616256; 760m 2048 32 37.57 24 1 768 67971 0 760470528
760m 2048 16 37.89 24 1 384 68551 0 760470528; 760m 2048 8 34.9 24 2 384 63147 0 760470528
760m 1024 8 39.76 48 2 768 78581 0 758897664; 760m 512 8 40.42 96 2 1536 83749 0 758111232
"""
FOUNDRY_FP8 = """
3b 32768 8 14.38 3 6 144 5856 1 2730480640; 3b 8192 8 23.28 3 6 144 19146 0 2667566080
3b 2048 8 27.7 10 6 480 30586 0 2651837440; 3b 512 8 30.25 40 6 1920 36527 0 2647905280
1b 32768 8 17.55 1 4 32 12580 0 1378865152; 1b 8192 8 20.71 2 4 64 32010 0 1328533504
1b 512 8 29.06 56 4 1792 70315 0 1312804864; 350m 32768 8 14.8 1 4 32 24439 0 387442688
350m 16384 8 15.31 2 4 64 42929 0 370665472; 350m 512 8 17.77 56 4 1792 154420 0 354412544
"""


def mpt(size: str, seq: int) -> dict:
    h, heads, layers = MPT[size]
    return dict(arch="gpt2", layers=layers, hidden=h, heads=heads, ffn=4 * h, vocab=50368, seq=seq, loss="fused")


def _foundry(text: str, precision: str) -> list[Run]:
    out = []
    for row in text.replace("\n", ";").split(";"):
        if not row.strip():
            continue
        size, seq, gpus, mfu, mb, accum, gb, tps, ac, params = row.split()
        seq, gpus, mb, accum, gb = int(seq), int(gpus), int(mb), int(accum), int(gb)
        layout = dict(dp=gpus, sharding="fsdp", microbatches=accum, global_batch=gb, precision=precision)
        layout["checkpoint_activations"] = ac == "1"
        m = mpt(size, seq)
        name = f"MPT-{size} seq {seq}, {gpus} GPUs, {mb}x{accum}{', AC' if ac == '1' else ''}, {precision}"
        notes = "torch 2.0.1 + CUDA 11.8, Triton flash attention (2022)"
        # no term attached: the 2023 stack's kernels were never measured here, so its rows stand as plain errors
        run = Run(name, LLM_FOUNDRY, m, layout, "h100", float(tps), None, float(mfu) / 100, int(params), notes)
        run = dataclasses.replace(run, family="llm-foundry")
        out.append(run)
    return out


def _measured_here() -> list[Run]:
    """Not published: the Llama steps benchmarks/gpu_constants.py ran on this workplace's H100
    (benchmarks/gpu_constants_h100.json; FSDP2 over one GPU, bf16 parameters, fp32 reduction,
    fused AdamW, torch 2.11), the hardware constants' own check."""
    model = dict(arch="llama", layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=4096)
    # re-measured 2026-11-26 with the per-op save list fixed (naming cuDNN's attention); the first
    # measurement (2026-11-23: 0.2141, 0.2581, 0.2953 s; reserved 52.10, 39.14, 42.14 GiB) is in
    # benchmarks/gpu_constants_h100.json, which still gives the H100's constants
    source = "benchmarks/data/gpu-h100-2026-11-26/gpu_constants.json (measured here)"
    out = []
    for ac, step, reserved in ((False, 0.2129, 52.08), (True, 0.2543, 39.14), ("op", 0.2906, 42.53)):
        layout = dict(dp=1, global_batch=2, sharding="fsdp", precision="bf16", checkpoint_activations=ac)
        unpriced = (OP_POLICY,) if recomputation(ac).per_op else ()
        name = f"here: Llama 1.5B, 1 H100, 2 x 4096, AC {ac}"
        out.append(
            Run(name, source, model, layout, "h100", 2 * 4096 / step, reserved, unpriced=unpriced, family="here")
        )
    return out


RUNS: list[Run] = _torchtitan() + _foundry(FOUNDRY_BF16, "bf16") + _foundry(FOUNDRY_FP8, "fp8") + _measured_here()
"""Every row: torchtitan's, llm-foundry's, then the steps measured on this workplace's H100."""
