"""Activations saved for backward on one rank, for any composed layout: each strategy's
module counts what its ops keep for one microbatch (memory.py the plain model, tensor.py TP /
SP, experts.py an MoE layer, with s/cp positions under CP); this module adds them up per
pipeline chunk, with recomputation, and walks the schedule (pipeline.peak_in_flight). The peak
of that walk is what the saved-tensor meter reports; the rules of the walk: DERIVATIONS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.precision import ELEM
from labkit.layout.schedules import chunk_layers, schedule_table, stage_of, style
from labkit.theory.exact import float8, latent, memory, tensor
from labkit.theory.exact.batch import microbatch_rows, stream_rows
from labkit.theory.exact.context import window_activation_bytes
from labkit.theory.exact.experts import layer_activation_bytes
from labkit.theory.exact.pipeline import peak_in_flight


def _bytes(
    cfg: ParallelConfig,
    model: ModelConfig,
    b: int,
    layers: int,
    head: bool,
    embed: bool,
    local: int = 0,
    tables: int | None = None,
    dense: int = 0,
) -> int:
    """What one microbatch of `b` sequences keeps in `layers` blocks (+ head / embedding), no recompute;
    `local`: the bytes the chunk's sliding-window layers keep beyond a global layer's (chunks());
    `dense` of the blocks with a dense MLP in place of the MoE layer (ModelConfig.dense_layers)."""
    act = ELEM[cfg.precision]
    # a cp rank keeps the activations of its own s/cp positions only (DERIVATIONS.md, "Context parallelism")
    seq = model.seq // cfg.cp
    if dense and model.experts:  # the dense blocks and the MoE blocks apart; the chunk's rotary tables once
        both = model.family.rotary and layers > dense
        rotary = memory.rotary_bytes(model, seq, act, tables) if both else 0  # MLA's: qk_rope_head_dim wide
        moe = _bytes(cfg, model, b, layers - dense, False, False, 0, tables)
        return _bytes(cfg, model.replace(experts=0), b, dense, head, embed, local, tables) + moe - rotary
    heads = layers * ulysses_bytes(cfg, model, b)
    heads += local  # the local layers' own bytes, summed by the caller (context.window_activation_bytes)
    if cfg.tp == 1:
        plain = memory.activation_bytes(
            model.replace(seq=seq), b, layers=layers, head=head, embed=embed, act_bytes=act, tables=tables
        )
        return plain + heads
    # tensor.activation_bytes reads the block count off the model and takes the sequence apart: under SP
    # the stream holds s/(cp·tp) rows of it while the gathered inputs, q, k, v and MoE layers keep all s/cp
    heads += layers * float8.tp_activation_delta(cfg, model, b, seq)  # fp8's inputs kept in fp8 (0 otherwise)
    return heads + tensor.activation_bytes(
        model.replace(layers=layers), b, cfg.tp, cfg.sequence_parallel, seq, act, head=head, embed=embed, tables=tables
    )


def ulysses_bytes(cfg: ParallelConfig, model: ModelConfig, b: int) -> int:
    """Ulysses keeps one more attention output per block, (b, s/cp, h/tp) in the compute dtype: the
    kernel saves its output as head shards (b, nh/(tp·cp), s, hd), the all-to-all back gives wo a
    tensor of its own (without CP, or with the other kinds, wo's input is the kernel's output).
    Selective recomputation drops it with the log-sum-exp; 0 for the other kinds."""
    if cfg.cp == 1 or not cfg.context.splits_heads or model.family.latent_attention:
        return 0  # MLA: wo's input is its own copy of the output (theory/exact/latent.py), whatever the kernel
    # heads·head_dim wide: h unless kv_channels sets head_dim apart (Qwen3, Gemma 3)
    return ELEM[cfg.precision] * b * (model.seq // cfg.cp) * (model.heads * model.head_dim // cfg.tp)


@dataclass(frozen=True)
class Chunk:
    """Bytes one microbatch leaves saved after a chunk's forward, and what its backward adds on
    top; `block`, `x` and `head` are the parts the routed variant recomputes."""

    forward: int
    backward_extra: int = 0
    block: int = 0
    x: int = 0
    head: int = 0
    dense: int = 0
    """Of the chunk's blocks, the first `dense` keep a dense MLP (ModelConfig.dense_layers)..."""
    dense_block: int = 0
    """... and rebuild this many bytes each (`block`: an MoE block's, the balanced R = N)."""


def lse_bytes(cfg: ParallelConfig, model: ModelConfig, b: int) -> int:
    """The attention kernel's log-sum-exp one block keeps, fp32 (b, heads/tp, s/cp): all that
    selective recomputation drops here (engines/parallel/checkpoint.py RecomputeCore)."""
    return 4 * b * (model.heads // cfg.tp) * (model.seq // cfg.cp)


def _kv(model: ModelConfig) -> int:
    """Width of k (and of v): KV heads times head dim."""
    return model.n_kv_heads * model.head_dim


def op_block_bytes(cfg: ParallelConfig, model: ModelConfig, b: int) -> int:
    """What a block keeps under torchtitan's per-op selective checkpointing (selective_ac_option
    'op'; torchtitan 9dec370, parallelize_llama.py `_save_list`): its input, the outputs of its
    1st, 3rd, 5th ... matmul (every second one is recomputed), the attention kernel's output and
    log-sum-exp, and under SP the reduce-scatters' outputs. Matmuls run wq, wk, wv, wo, then fc1,
    fc2 (gpt) or gate, up, down (llama); a row-parallel one's output is the full-width partial
    sum. An MoE layer's grouped products are not matmuls to the policy: recomputed whole."""
    e, t, h, f = ELEM[cfg.precision], cfg.tp, model.hidden, model.ffn
    s, rows = model.seq // cfg.cp, stream_rows(cfg, model)
    q = model.heads * model.head_dim  # h unless kv_channels sets head_dim apart
    widths = [q // t, _kv(model) // t, _kv(model) // t, h]  # wq, wk, wv, wo
    if model.family.latent_attention:  # MLA's five (or four) matmuls (theory/exact/latent.py)
        widths = latent.matmul_widths(model, t)
    # an MoE layer's grouped expert products are not matmuls to the policy: nothing of its MLP is saved
    if not model.experts:
        widths += [f // t, f // t, h] if model.family.gated_mlp else [f // t, h]
    # every second matmul's output is saved (1st, 3rd, ...), each over all s positions: a column-parallel
    # output is on the gathered sequence, a row-parallel one the full-width partial sum before its reduction
    mm = sum(widths[::2]) * e * b * s
    # SP's two reduce-scatters (after wo, after the MLP) leave this rank's stream rows: saved by the policy
    scatters = 2 * e * b * rows * h if cfg.sequence_parallel else 0
    # the block's input + the saved products + the attention output (b, s, h/t) + its lse + SP's scatters
    out = e * b * s * (model.heads // t * model.v_head_dim if model.family.latent_attention else q // t)
    return e * b * rows * h + mm + out + lse_bytes(cfg, model, b) + scatters


def _rebuild_extra(blocks: list[int], x: int, head: int) -> int:
    """What a recomputed chunk's backward adds over its forward's kept bytes: block l is rebuilt while
    the inputs of blocks 0..l-1 are still kept (l·x; later ones were freed by their backward), the head
    freed first, the rebuilt block replacing its kept input: max_l(block_l + l·x) - L·x - head, >= 0."""
    top = max((blk + i * x for i, blk in enumerate(blocks)), default=0)
    return max(0, top - len(blocks) * x - head) if blocks else 0


def chunk(
    cfg: ParallelConfig,
    model: ModelConfig,
    layers: int,
    head: bool,
    embed: bool,
    local: int = 0,
    tables: int | None = None,
    own: tuple[int, ...] = (),
    pairs: tuple[int, ...] | None = None,
    dense: int = 0,
) -> Chunk:
    """One pipeline chunk (or the whole model when pp == 1) for one microbatch, under the
    config's recomputation: none; 'selective' (the attention core: its log-sum-exp is not kept,
    and its recomputation never adds to the peak, as the rest of its block is freed by then);
    'full' (a block keeps its input, one block at a time is rebuilt in backward); 'op'
    (`op_block_bytes` kept, the rest rebuilt one block at a time). `local`: what the chunk's
    sliding-window layers keep beyond global ones, `own` the same per block and `pairs` the rotary
    pairs each block uses (Gemma 3, SmolLM3; None: the model's, every block alike); `dense`: of the
    chunk's blocks, the first keep a dense MLP (ModelConfig.dense_layers)."""
    b = microbatch_rows(cfg)
    r = cfg.recomputation
    # no block's forward rerun (none, 'selective'): all is kept but, under 'selective', each block's lse
    # (Korthikanti et al. 2022, section 4.2; DERIVATIONS.md, "Activations per rank": the rest stays)
    if not r.reruns_forward:
        dropped = layers * (lse_bytes(cfg, model, b) + ulysses_bytes(cfg, model, b)) if r.attention_only else 0
        dropped += local if r.attention_only else 0  # a local layer's own bytes are all inside its core
        if r.attention_only and model.family.latent_attention:  # and MLA's kernel output (wo keeps a copy)
            dropped += layers * latent.kernel_output_bytes(model, b, model.seq // cfg.cp, cfg.tp, ELEM[cfg.precision])
        return Chunk(_bytes(cfg, model, b, layers, head, embed, local, tables, dense) - dropped)
    # 'op' with dense first layers is refused at the door (labkit/config/moe.py moe_layout_problems)
    if r.per_op:
        x = op_block_bytes(cfg, model, b)
    else:
        x = ELEM[cfg.precision] * b * stream_rows(cfg, model) * model.hidden  # a block's input, all it keeps
    # one whole block, no head or embedding: the most that is rebuilt at a time in backward
    block = _bytes(cfg, model, b, 1, False, False, 0, None if pairs is None else 0)
    # the head and the embedding are never checkpointed: they keep all they keep under any policy
    head_bytes = _bytes(cfg, model, b, 0, True, False) if head else 0
    kept = _bytes(cfg, model, b, 0, False, True) if embed else 0
    # the loss's backward frees the head before the first block is rebuilt, and the rebuilt block
    # replaces its kept input: extra over the forward's total is block - x - head, never below 0;
    # a chunk with no blocks (stage_layers may give a stage 0) rebuilds nothing
    dense_block = _bytes(cfg, model.replace(experts=0), b, 1, False, False) if dense and model.experts else 0
    extra = _rebuild_extra([dense_block] * dense + [block] * (layers - dense), x, head_bytes)
    if own or pairs:  # blocks of unequal size (Gemma 3's local layers, its rotary pairs): block l is rebuilt
        # while the inputs of blocks 0..l-1 are still kept, as routed() walks an MoE chunk's layers
        pair = memory.rotary_bytes(model, model.seq // cfg.cp, ELEM[cfg.precision], 1)
        sizes = [block + (own[i] if own else 0) + pair * (pairs[i] if pairs else 0) for i in range(layers)]
        rebuilt = max(size + i * x for i, size in enumerate(sizes))
        extra, block = max(0, rebuilt - layers * x - head_bytes), max(sizes)
    return Chunk(kept + layers * x + head_bytes, extra, block, x, head_bytes, dense, dense_block)


def routed(cfg: ParallelConfig, model: ModelConfig, c: Chunk, received: list[int]) -> Chunk:
    """Chunk `c` for a microbatch whose MoE layers' experts received `received[l]` rows each
    (routing dependent under ep; `c` assumes the balanced R = N): every layer's R rows kept; or,
    recomputed, block l rebuilt while the inputs of blocks 0..l are still kept (later ones were
    freed by their backward): the backward adds max_l(block_l + l·x) - L·x - head."""
    b, act = microbatch_rows(cfg), ELEM[cfg.precision]
    seq = model.seq // cfg.cp
    # each MoE layer's bytes with its R received rows, less the balanced R = N that `c` counted
    delta = [
        layer_activation_bytes(model, b, seq, act, received=r) - layer_activation_bytes(model, b, seq, act)
        for r in received
    ]
    # every layer's routed rows are kept through the forward at once: they simply add
    if not cfg.recomputation.reruns_forward:
        return Chunk(c.forward + sum(delta))
    # backward rebuilds block L-1 first, then down to 0: at block l's rebuild the inputs of blocks
    # 0..l-1 are still kept (l·x) beside it, and the heaviest layer need not be the last one
    blocks = [c.dense_block] * c.dense + [c.block + d for d in delta]
    return Chunk(c.forward, _rebuild_extra(blocks, c.x, c.head), c.block, c.x, c.head, c.dense, c.dense_block)


def chunks(cfg: ParallelConfig, model: ModelConfig, pp_rank: int, cp_rank: int = 0) -> dict[int, Chunk]:
    """Each of pipeline rank `pp_rank`'s chunks (chunk 0: the whole model when pp == 1)."""
    # without a pipeline there is one chunk whatever virtual_stages says
    p, v, placement = cfg.pp, cfg.virtual_stages if cfg.pp > 1 else 1, style(cfg.schedule)
    out = {}
    for c in range(v):
        # the stage, not c, says whether a chunk holds the embedding (stage 0) or the head (the last):
        # a V-shaped schedule puts rank r's chunks on stages r and 2p-1-r (schedules.style)
        s = stage_of(pp_rank, c, p, placement)
        blocks = chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers, placement)
        b = microbatch_rows(cfg)
        # Gemma 3's sliding-window layers: what each keeps beyond a global layer (this cp rank's windows)
        windows = [w for w in map(model.layer_window, blocks) if w is not None]
        local = sum(window_activation_bytes(cfg, model, b, cp_rank, w) for w in windows)
        # the rotary pairs its blocks use (Gemma 3: a chunk of local layers keeps the local pair only;
        # SmolLM3: a chunk of NoPE layers none)
        varied = model.rope_local_theta is not None or model.nope_interval  # else: one pair, any chunk with blocks
        tables = memory.table_kinds(model, blocks) if varied else None
        own = tuple(
            window_activation_bytes(cfg, model, b, cp_rank, w) if w else 0 for w in map(model.layer_window, blocks)
        )
        pairs = tuple(memory.table_kinds(model, [i]) for i in blocks) if varied else None
        dense = sum(not model.moe_layer(i) for i in blocks) if model.experts else 0  # DeepSeek-V3's first dense
        out[c] = chunk(
            cfg, model, len(blocks), s == p * v - 1, s == 0, local, tables, own if windows else (), pairs, dense
        )
    return out


def peak(
    cfg: ParallelConfig, model: ModelConfig, pp_rank: int = 0, received: dict | None = None, cp_rank: int = 0
) -> int:
    """Peak bytes saved for backward on a rank at pipeline coordinate `pp_rank` over one step.
    received: {(microbatch, chunk): [R of each MoE layer of the chunk]}, rows each layer's experts
    got (routing dependent under ep; read off a run's combine all-to-alls) for the exact value;
    default the balanced R = N."""
    held = float8.fsdp2_saved_scales(cfg, model)  # FSDP2's fp8 weights, saved, hold the step's scales
    if received is None:
        return _peak(cfg, model, pp_rank, cp_rank) + held
    return _walk(cfg, model, pp_rank, received, cp_rank) + held


# frozen configs hash: estimate and the planner ask for the same (layout, rank) many times over;
# a routed walk (received given) depends on one run's routing and is not cached
@lru_cache(maxsize=4096)
def _peak(cfg: ParallelConfig, model: ModelConfig, pp_rank: int, cp_rank: int = 0) -> int:
    return _walk(cfg, model, pp_rank, None, cp_rank)


def _walk(cfg: ParallelConfig, model: ModelConfig, pp_rank: int, received: dict | None, cp_rank: int = 0) -> int:
    base = chunks(cfg, model, pp_rank, cp_rank)

    def per(mb: int, c: int) -> Chunk:
        return base[c] if received is None else routed(cfg, model, base[c], received[mb, c])

    if cfg.pp == 1:  # accumulation: each microbatch's graph is freed before the next forward
        return max(per(mb, 0).forward + per(mb, 0).backward_extra for mb in range(cfg.microbatches))
    v = cfg.virtual_stages
    # this rank's chunks on stage 0 (rank 0's chunk 0; empty on every other rank)
    first = tuple(c for c in range(v) if stage_of(pp_rank, c, cfg.pp, style(cfg.schedule)) == 0)
    # under CP the first stage's positions (this rank's zigzag indices, 8·s/cp bytes) are one
    # tensor for every microbatch: counted once however many are in flight (the meter counts storages)
    # (llama has no position table: nothing keeps them)
    shared = 8 * (model.seq // cfg.cp) if cfg.cp > 1 and first and not model.family.rotary else 0
    # the executor's own action list (DERIVATIONS.md, "Pipeline parallelism"): the peak depends on the
    # order of F and B, not only on how many microbatches are in flight
    actions = schedule_table(cfg.schedule, cfg.pp, cfg.microbatches, v).actions[pp_rank]
    return peak_in_flight(
        actions,
        # each microbatch counts its bytes without the shared positions; peak_in_flight adds them back once
        kept=lambda mb, c: per(mb, c).forward - (shared if c in first else 0),
        extra=lambda mb, c: per(mb, c).backward_extra,
        shared=shared,
        first=first,
    )
