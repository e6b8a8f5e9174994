"""The tensor-parallel styles as data: module name -> style (Shoeybi et al. 2019, section 3;
Korthikanti et al. 2022, section 4.2.2 for SP). The executor (engines/parallel/tensor/,
tensor/dtensor.py), the theory (labkit/theory/exact/params.py, tensor.py) and the notebooks read this
one table. The styles are listed at `tp_styles`; why an MoE layer is replicated over tp, what its
'all-gather-replicated' input and 'split' output are, and how KV heads are shared when tp >
kv_heads, is in DERIVATIONS.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig
from labkit.layout.float8 import block_linears, converts


def tp_styles(model: ModelConfig, sequence_parallel: bool = False, tp: int = 1, fp8: bool = False) -> dict[str, dict]:
    """Module name -> style dict for the model (engines/model.py, every family). Styles:
      colwise    weight rows (output features) split over tp: Y_i = X A_i, no communication; a
                 bias is split with its rows. `kv_groups`: wk / wv when tp > kv_heads — the rows
                 cut into kv_heads groups (one KV head each), group j held whole by the tp/kv_heads
                 consecutive tp ranks whose query heads read it (as vLLM replicates KV heads); their
                 partial gradients are summed over those ranks (DERIVATIONS.md)
      rowwise    weight columns (input features) split: partial Y = X_i B_i, then `output`; a bias
                 is added once, after `output` (replicated; partial per rank under SP)
      vocab      an embedding table / LM head split along the vocabulary (a tied head is the
                 embedding's slice: vocab-parallel on both ends)
      input      what the module's input goes through first, once for all its colwise layers
                 (attention: wq, wk, wv share one): 'copy' (the paper's f: identity forward,
                 all-reduce backward) or, with sequence parallelism, 'all-gather' along the sequence
      replicate  every tp rank holds the whole parameter and computes the same values
      sequence   replicated parameters applied to this rank's s/tp positions (norms, position
                 embedding under SP): the gradient is partial per tp rank and summed over tp
      latent     MLA's down-projections to its latents and their norms (wq_a, q_norm, wkv_a, kv_norm):
                 replicated and applied to every position, but the latents feed only this rank's
                 heads, so the gradient is partial per tp rank and summed over tp (Megatron-Core
                 multi_latent_attention.py: linear_q_down_proj / linear_kv_down_proj built
                 "duplicated", their grads all-reduced over tp; torchtitan deepseek_v3
                 parallelize.py leaves wkv_a and kv_norm out of its TP plan, replicated)
      heads      replicated parameters applied to this rank's heads (Qwen3's and Gemma 3's q_norm,
                 k_norm): the gradient is partial per tp rank and summed over tp, SP or not
                 (transformers' plan 'replicated_with_grad_allreduce'; Megatron all-reduces its
                 q_layernorm / k_layernorm gradients over TP, finalize_model_grads)
    `output` of a rowwise / vocab embedding: 'all-reduce' (the paper's g) or 'reduce-scatter'
    (SP: the sum lands sequence-sharded); the LM head's is the vocab-parallel cross-entropy, whose
    two small all-reduces (max, then sum-exp with the target logit) replace gathering (b, s, V).

    `fp8` (precision='fp8', tensorwise): a colwise or rowwise layer that converts (layout/float8.py)
    is marked "fp8": True — its split operands take their amax over tp (a rowwise layer's input, a
    colwise layer's output gradient, either weight) — and under SP a module whose colwise layers all
    convert gathers its input in fp8, 'all-gather-fp8' (the shard cast with the whole sequence's
    amax, then all-gathered at one byte an element: torchao's PrepareFloat8ModuleInput, as
    torchtitan's float8 TP plan uses it)."""
    enter = {"style": "input", "input": "all-gather" if sequence_parallel else "copy"}
    leave = "reduce-scatter" if sequence_parallel else "all-reduce"
    norm = {"style": "sequence" if sequence_parallel else "replicate"}
    kv = model.n_kv_heads
    kv_style = {"style": "colwise", "shard_dim": 0}
    if tp > kv:
        kv_style["kv_groups"] = kv
    styles = {"embed.tok": {"style": "vocab", "shard_dim": 0, "output": leave}}
    if not model.family.rotary:  # a learned position table
        styles["embed.pos"] = dict(norm)
    for i in range(model.layers):
        b = f"blocks.{i}."
        styles[b + "ln1"] = dict(norm)
        styles[b + "attn"] = dict(enter)
        if model.family.latent_attention:  # MLA: heads split, the latents whole (DERIVATIONS.md)
            colwise = {"style": "colwise", "shard_dim": 0}  # wq_b / wkv_b rows: whole heads per rank
            latent = ("wq_a", "q_norm", "wkv_a", "kv_norm") if model.q_lora_rank else ("wkv_a", "kv_norm")
            styles.update({b + "attn." + n: {"style": "latent"} for n in latent})
            styles.update({b + "attn." + n: dict(colwise) for n in ("wq_b" if model.q_lora_rank else "wq", "wkv_b")})
        else:
            styles[b + "attn.wq"] = {"style": "colwise", "shard_dim": 0}  # whole heads per rank
            styles[b + "attn.wk"] = dict(kv_style)
            styles[b + "attn.wv"] = dict(kv_style)
        styles[b + "attn.wo"] = {"style": "rowwise", "shard_dim": 1, "output": leave}
        if model.qk_norm:
            styles[b + "attn.q_norm"] = {"style": "heads"}
            styles[b + "attn.k_norm"] = {"style": "heads"}
        styles[b + "ln2"] = dict(norm)
        if model.family.sandwich_norm:  # after wo's and the MLP's output: sequence-sharded under SP, as ln1
            styles[b + "ln1_post"] = dict(norm)
            styles[b + "ln2_post"] = dict(norm)
        if model.moe_layer(i):  # replicated over tp, split by ep instead (DERIVATIONS.md); shared experts too
            styles[b + "mlp"] = (
                {"style": "replicate", "input": "all-gather-replicated", "output": "split"}
                if sequence_parallel
                else {"style": "replicate"}
            )
            styles[b + "mlp.router"] = {"style": "replicate"}
            # the shared experts replicated with the layer, as DeepSeek-V3 trains with no TP at all
            # (technical report section 3.2); Megatron splits them over tp instead (SharedExpertMLP)
            shared = ("gate", "up", "down") if model.family.gated_mlp else ("fc1", "fc2")
            for name in shared if model.shared_experts else ():
                styles[b + f"mlp.shared.{name}"] = {"style": "replicate"}
            continue
        styles[b + "mlp"] = dict(enter)
        up, down = (("gate", "up"), "down") if model.family.gated_mlp else (("fc1",), "fc2")
        for name in up:
            styles[b + f"mlp.{name}"] = {"style": "colwise", "shard_dim": 0}
        styles[b + f"mlp.{down}"] = {"style": "rowwise", "shard_dim": 1, "output": leave}
    styles["head.norm"] = dict(norm)
    styles["head.proj"] = {
        "style": "vocab",
        "shard_dim": 0,
        "input": enter["input"],
        "output": "vocab-parallel cross-entropy",
    }
    if model.tied:
        styles["head.proj"]["tied"] = "embed.tok"
    if fp8:
        _float8(styles, model)
    return styles


def _float8(styles: dict[str, dict], model: ModelConfig) -> None:
    """Mark the layers that compute in fp8, and the SP inputs gathered in fp8 (tp_styles, `fp8`)."""
    shapes = block_linears(model)
    for name, style in styles.items():
        block, _, rest = name.partition(".")
        local = rest.partition(".")[2]  # 'attn.wq' of 'blocks.0.attn.wq'
        if block == "blocks" and local in shapes and converts(name, *shapes[local]):
            style["fp8"] = True
    for name, style in styles.items():
        if style.get("input") == "all-gather" and style["style"] == "input":
            layers = [s for n, s in styles.items() if n.startswith(name + ".") and s["style"] == "colwise"]
            if layers and all(s.get("fp8") for s in layers):
                style["input"] = "all-gather-fp8"


def param_style(styles: dict[str, dict], param_name: str) -> dict:
    """The style of the module that owns `param_name` ('blocks.0.attn.wq.weight' -> attn.wq's)."""
    return styles[param_name.rsplit(".", 1)[0]]


def shard_box(full_shape, dim: int, tp: int, tp_rank: int) -> list[list[int]]:
    """[start, stop) per tensor dim of the slice rank `tp_rank` holds: an even split along `dim`."""
    box = [[0, n] for n in full_shape]
    size = full_shape[dim] // tp
    box[dim] = [tp_rank * size, (tp_rank + 1) * size]
    return box


def local_param(styles: dict[str, dict], name: str, full_shape, tp: int, tp_rank: int = 0):
    """(local shape, box or None, extra reduce dims, replica dims) of one parameter under `styles`."""
    if name.endswith("attn.sinks"):  # GPT-OSS: one per query head, split with wq's rows (whole heads per rank)
        box = shard_box(full_shape, 0, tp, tp_rank)
        return tuple(b - a for a, b in box), box, (), ()
    style = param_style(styles, name)
    kind = style["style"]
    if kind == "rowwise" and name.endswith(".bias"):  # added once, after the reduction
        if style["output"] == "reduce-scatter":
            return tuple(full_shape), None, ("tp",), ("tp",)
        return tuple(full_shape), None, (), ("tp",)
    if "kv_groups" in style:  # one KV head's rows, shared by tp / kv_groups ranks
        g = style["kv_groups"]
        box = shard_box(full_shape, 0, g, tp_rank // (tp // g))
        return tuple(b - a for a, b in box), box, (), ()
    if "shard_dim" in style:
        box = shard_box(full_shape, style["shard_dim"], tp, tp_rank)
        return tuple(b - a for a, b in box), box, (), ()
    extra = ("tp",) if kind in ("sequence", "latent", "heads") else ()
    return tuple(full_shape), None, extra, ("tp",)
