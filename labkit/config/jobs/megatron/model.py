"""Megatron-LM's model arguments -> labkit's ModelConfig (labkit/config/jobs/megatron/ reads the layout).

Follows Megatron-LM core_v0.14.0 (commit 23e00ed0): megatron/training/arguments.py for the names and
defaults; megatron/core/models/gpt/gpt_layer_specs.py for what --multi-latent-attention builds (the
latents normalised only with --qk-layernorm, TE's LayerNormLinear); megatron/core/transformer/
transformer_config.py (MLATransformerConfig) for YaRN's fixed fields (original context 4096, beta_fast
32, beta_slow 1); megatron/core/transformer/moe/moe_utils.py (topk_routing_with_score_function) for
the router: softmax over the top-k logits (renormalised) unless --moe-router-pre-softmax, sigmoid
scores divided by their sum when top-k > 1, the group score the sum of a group's top-(k / group-topk).
"""

from __future__ import annotations

import ast

from labkit.config import ModelConfig, RopeScaling
from labkit.config.choices import ConfigError, family
from labkit.config.jobs.megatron.args import Args
from labkit.config.latent import YarnRope
from labkit.config.norms import norm_kind

MLA_ROPE = {"original_max_position": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
"""MLATransformerConfig's YaRN fields that no argument sets (core_v0.14.0)."""


def layer_pattern(text: str, layers: int) -> list[int]:
    """--moe-layer-freq as Megatron reads it (arguments.py moe_freq_type): N -> every Nth layer is
    MoE (layer i when i % N == 0); a Python list expression ('[0]*3+[1]*58') -> one 0/1 per layer."""
    if "[" not in text:
        try:
            n = int(text)
        except ValueError:
            raise ConfigError([f"--moe-layer-freq {text!r} is not a whole number or a list pattern"]) from None
        return [int(i % n == 0) for i in range(layers)]

    def value(node):  # lists of 0/1, + and * by whole numbers: what Megatron's eval of the pattern takes
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = value(node.left), value(node.right)
            return a + b if isinstance(node.op, ast.Add) else a * b
        raise ValueError

    try:
        pattern = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        raise ConfigError([f"--moe-layer-freq {text!r} is not a list of 0 and 1 built with + and *"]) from None
    if not isinstance(pattern, list) or len(pattern) != layers or set(pattern) - {0, 1}:
        raise ConfigError([f"--moe-layer-freq {text!r} must give 0 or 1 for each of --num-layers {layers} layers"])
    return pattern


def moe_fields(a: Args, arch: str, layers: int, ffn: int, notes: list[str]) -> dict:
    """The MoE fields of ModelConfig, or {} for a dense model."""
    experts = a.get("num-experts", int, 0) or 0
    if not experts:
        return {}
    pattern = layer_pattern(a.get("moe-layer-freq", str, "1"), layers)
    dense = pattern.index(1) if 1 in pattern else layers
    if pattern != [0] * dense + [1] * (layers - dense):
        raise ConfigError(
            [
                f"--moe-layer-freq {a.args['moe-layer-freq']}: MoE layers {[i for i, x in enumerate(pattern) if x]} "
                "are not all the layers after the first dense ones; labkit builds dense layers first, then "
                "MoE layers (DeepSeek-V3's first_k_dense_replace)"
            ]
        )
    moe_ffn = a.get("moe-ffn-hidden-size", int, ffn)
    top_k = a.get("moe-router-topk", int, 2)
    out = {"experts": experts, "top_k": top_k, "dense_layers": dense}
    # one ffn serves both while every layer is MoE; dense layers keep --ffn-hidden-size apart
    out.update({"ffn": moe_ffn} if not dense else {"ffn": ffn, "moe_ffn": moe_ffn})
    shared = a.get("moe-shared-expert-intermediate-size", int)
    if shared is not None:
        if shared % moe_ffn:
            raise ConfigError(
                [
                    f"--moe-shared-expert-intermediate-size {shared} is not a multiple of the experts' width "
                    f"{moe_ffn}: labkit's shared experts are shared_experts x moe_ffn wide; give a multiple"
                ]
            )
        out["shared_experts"] = shared // moe_ffn
    if a.flag("moe-shared-expert-gate"):
        raise ConfigError(["--moe-shared-expert-gate (Qwen2-MoE's sigmoid-gated shared expert) is not built"])
    sigmoid = a.get("moe-router-score-function", str, "softmax") == "sigmoid"
    pre_softmax = a.flag("moe-router-pre-softmax")
    out["router"] = "sigmoid" if sigmoid else "softmax"
    # sigmoid: divided by their sum when top-k > 1; softmax: over the top-k logits unless pre-softmax
    renorm = top_k > 1 if sigmoid else not pre_softmax
    if renorm != family(arch).gated_mlp:
        out["norm_topk_prob"] = renorm  # said only where it differs from the family's default
    groups, group_topk = a.get("moe-router-num-groups", int), a.get("moe-router-group-topk", int)
    if groups:
        out["n_group"], out["topk_group"] = groups, group_topk or groups
        best = top_k // out["topk_group"]
        if best != 2:
            notes.append(
                f"--moe-router-group-topk {out['topk_group']}: Megatron scores a group by its top-{best} experts; "
                "labkit by its top 2 (DeepSeek-V3's)"
            )
    out["routed_scaling_factor"] = a.get("moe-router-topk-scaling-factor", float, 1.0)
    if a.flag("moe-router-enable-expert-bias"):
        if not sigmoid:
            raise ConfigError(
                [
                    "--moe-router-enable-expert-bias with the softmax router: labkit's aux-loss-free bias runs "
                    "with --moe-router-score-function sigmoid (DeepSeek-V3's)"
                ]
            )
        out["bias_update_speed"] = a.get("moe-router-bias-update-rate", float, 1e-3)
    balance = a.get("moe-router-load-balancing-type", list, ["aux_loss"])
    coeff = a.get("moe-aux-loss-coeff", list, ["0.0"])
    out["aux_loss_coef"] = float(coeff[0]) if balance != ["none"] else 0.0
    if balance not in (["seq_aux_loss"], ["none"]):
        notes.append(
            f"--moe-router-load-balancing-type {' '.join(balance)}: labkit's balance loss is taken per "
            "sequence (Megatron's seq_aux_loss), its coefficient the job's"
        )
    return out


def mla_fields(a: Args, notes: list[str]) -> dict:
    """Multi-latent attention's fields (arch 'deepseek_v3')."""
    if not a.flag("qk-layernorm"):
        raise ConfigError(
            [
                "--multi-latent-attention without --qk-layernorm: Megatron then leaves the latents un-normalised; "
                "labkit's MLA normalises them (DeepSeek-V3's q_norm and kv_norm): add --qk-layernorm"
            ]
        )
    a.get("kv-channels", int)  # MLA's heads are --qk-head-dim / --v-head-dim wide; --kv-channels goes unused
    factor = a.get("rotary-scaling-factor", float, 1.0)
    yarn = None
    if factor > 1:  # YaRN at factor 1 is plain RoPE
        yarn = YarnRope(
            factor=factor, mscale=a.get("mscale", float, 1.0), mscale_all_dim=a.get("mscale-all-dim", float, 0.0),
            **MLA_ROPE,
        )  # fmt: skip
    return {
        "q_lora_rank": a.get("q-lora-rank", int),
        "kv_lora_rank": a.get("kv-lora-rank", int, 32),
        "qk_nope_head_dim": a.get("qk-head-dim", int, 128),
        "qk_rope_head_dim": a.get("qk-pos-emb-head-dim", int, 64),
        "v_head_dim": a.get("v-head-dim", int, 128),
        "yarn": yarn,
    }


NORMS = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}
"""--normalization's values (core_v0.14.0 arguments.py: LayerNorm, its default, and RMSNorm) -> ModelConfig.norm.
Megatron's LayerNorm has a weight and a bias whatever the linears' --disable-bias-linear; --apply-layernorm-1p
stores its weight as w - 1 (zero-centred), the same parameters."""
TOKENIZER_FILES = ("vocab-file", "merge-file", "tokenizer-model")
"""The arguments that name a tokenizer's files instead of a vocabulary size."""
GPT2_VOCAB = 50_257
"""GPT-2's BPE vocabulary (its encoder.json: 50,000 merges, 256 bytes and the end-of-text token), what
--tokenizer-type GPT2BPETokenizer with --vocab-file / --merge-file reads."""


def model_of(a: Args, vocab: int | None, problems: list[str], tp: int = 1) -> tuple[ModelConfig | None, list[str]]:
    """The model the arguments build, and the notes; each thing labkit cannot build appended to `problems`
    (None where the model cannot be built at all), so that a file's every problem is named at once."""
    notes: list[str] = []
    need = {n: a.get(n, int) for n in ("num-layers", "hidden-size", "num-attention-heads", "seq-length")}
    vocab = a.get("vocab-size", int, vocab)
    missing = [f"--{n}" for n, v in need.items() if v is None]
    if missing:
        problems.append(f"the arguments have no {', '.join(missing)}, which the model needs; give them")
    if vocab is None:
        problems.append(vocab_problem(a, tp))
    swiglu, norm_name = a.flag("swiglu"), a.get("normalization", str, "LayerNorm")
    pos = a.get("position-embedding-type", str, "learned_absolute")
    # the MLP and the positions choose the family; the norm is a field of its own (ModelConfig.norm)
    llama = (swiglu, pos) == (True, "rope")
    mix = (swiglu, pos) in ((True, "rope"), (False, "learned_absolute"))
    if not mix:
        problems.append(
            f"--swiglu {'on' if swiglu else 'off'} with --position-embedding-type {pos}: labkit builds SwiGLU with "
            "rope (llama) and GELU with a learned table (gpt2); give --swiglu with rope, or neither"
        )
    if norm_name not in NORMS:
        problems.append(f"--normalization {norm_name}: labkit builds {' or '.join(NORMS)}; give one of those")
    norm = NORMS.get(norm_name, "layernorm")
    no_bias = a.flag("disable-bias-linear")
    if mix and llama and not no_bias:  # (a family the arguments do not make: its biases say nothing more)
        problems.append(
            "--swiglu with rope but without --disable-bias-linear: Megatron adds biases to every linear, which "
            "labkit's llama does not have; add --disable-bias-linear"
        )
    if mix and not llama and no_bias:
        problems.append("--disable-bias-linear on a GELU model: labkit's gpt2 has biases; remove it")
    if a.get("rotary-percent", float, 1.0) != 1.0:
        problems.append(f"--rotary-percent {a.args['rotary-percent']}: labkit rotates every dimension; give 1.0")
    if not llama and a.flag("no-position-embedding"):
        problems.append("--no-position-embedding on a learned_absolute model: labkit's gpt2 has its table; remove it")
    if a.flag("apply-layernorm-1p"):  # the same weights, stored as w - 1: the count and the bytes are labkit's
        notes.append("--apply-layernorm-1p: the norms scale by 1 + w (zero-centred); labkit's by w, the same count")
    mla = a.flag("multi-latent-attention")
    if mla and not (llama and norm == "rmsnorm"):
        problems.append("--multi-latent-attention: labkit builds it with --swiglu, RMSNorm and rope (DeepSeek-V3)")
    if missing or vocab is None:
        return None, notes
    layers, h, heads, seq = need.values()
    # validate_args' defaults: SwiGLU's two up-projections at 2/3 of 4h keep the parameters of a 4h MLP
    ffn = a.get("ffn-hidden-size", int, int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    arch = "deepseek_v3" if mla else "llama" if llama else "gpt2"
    fields = mla_fields(a, notes) if mla else {}
    # the family's own norm is its default; another is said by name (a llama with LayerNorm: Megatron's default)
    fields["norm"] = "default" if norm_kind(arch, "default") == norm_kind(arch, norm) else norm
    fields = {"ffn": ffn, **fields, **moe_fields(a, arch, layers, ffn, notes)}
    if a.get("mtp-num-layers", int):
        notes.append(
            f"--mtp-num-layers {a.args['mtp-num-layers']}: the multi-token prediction module is not built; its "
            "parameters are not in the count (DeepSeek-V3's published 671B leaves it out too)"
        )
    if not mla:
        head = a.get("kv-channels", int)
        if head is not None and head != h // heads:
            fields["kv_channels"] = head
    rope = None
    # Megatron's llama 3.x scaling has low 1, high 4 and an original context of 8192 fixed in
    # rotary_pos_embedding.py; only the factor is an argument
    if a.flag("use-rope-scaling"):
        rope = RopeScaling(
            factor=a.get("rope-scaling-factor", float, 8.0),
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position=8192,
        )
    positions = a.get("max-position-embeddings", int, seq)
    # a rope model has no position table; a learned one is sized by max-position-embeddings in Megatron
    if not llama and positions != seq:
        notes.append(
            f"--max-position-embeddings {positions}: labkit's learned position table has --seq-length "
            f"{seq} rows, {(positions - seq) * h:,} parameters fewer than the job's"
        )
    gqa = a.flag("group-query-attention")
    tied = not a.flag("untie-embeddings-and-output-weights")  # Megatron ties unless told
    try:
        model = ModelConfig(
            arch=arch,
            layers=layers,
            hidden=h,
            heads=heads,
            vocab=vocab,
            seq=seq,
            # --num-query-groups counts only with --group-query-attention (its default 1 is otherwise unused)
            kv_heads=a.get("num-query-groups", int, 1) if gqa and not mla else None,
            tie_embeddings=None if tied == family(arch).ties else tied,
            qkv_bias=a.flag("add-qkv-bias"),
            norm_eps=a.get("norm-epsilon", float, 1e-5),
            rope_theta=float(a.get("rotary-base", int, 10000)),
            rope_scaling=rope,
            # Megatron always pads (default 128 x TP); the published count stays the unpadded one
            vocab_divisible_by=a.get("make-vocab-size-divisible-by", int, 128),
            **fields,
        )
    except ConfigError as e:  # a field the arguments set that labkit refuses: one more problem of the file
        problems.extend(e.problems)
        return None, notes
    return model, notes


def vocab_problem(a: Args, tp: int) -> str:
    """No --vocab-size: what the script names instead, and how to give the size."""
    # a file's flag with no value: the script's path argument left empty on a bare run
    files = [f"--{n} {a.args[n]}".strip() if a.args[n] else f"--{n}" for n in TOKENIZER_FILES if n in a.args]
    said = f"the script names a tokenizer ({', '.join(files)}) but no --vocab-size" if files else "no --vocab-size"
    fix = "labkit reads no tokenizer: give vocab= to read_job (on the command line --vocab N)"
    if "vocab-file" in a.args or a.get("tokenizer-type", str) == "GPT2BPETokenizer":
        div = a.get("make-vocab-size-divisible-by", int, 128) * tp
        padded = -(-GPT2_VOCAB // div) * div
        fix += (
            f"; GPT-2's BPE has {GPT2_VOCAB:,} entries (vocab={GPT2_VOCAB}), which Megatron pads to a multiple of "
            f"--make-vocab-size-divisible-by x TP = {div:,}: {padded:,} rows"
        )
    return f"{said}: {fix}"
