"""The fine-grained MoE fields of a Hugging Face config.json -> ModelConfig's.

Qwen3MoeForCausalLM (transformers models/qwen3_moe/configuration_qwen3_moe.py) and DeepseekV3ForCausalLM
(models/deepseek_v3/configuration_deepseek_v3.py) name the same ideas differently; `moe_fields` reads
either into experts, top_k, moe_ffn, norm_topk_prob, shared_experts, router, n_group, topk_group,
routed_scaling_factor and dense_layers. Their attention (Qwen3's q/k norms, DeepSeek-V3's MLA) is read
by the attention parts; ModelConfig.from_hf joins them. What labkit does not build is refused by name:
Qwen3-MoE's dense layers placed by `mlp_only_layers` or `decoder_sparse_step` (labkit's dense layers
are the first ones), Qwen2-MoE's sigmoid-gated shared expert, a DeepSeek router other than V3's.
"""

from __future__ import annotations

from labkit.config.hf.keys import _read

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"


def moe_fields(c: dict, arch: str) -> tuple[dict, list[str]]:
    """(ModelConfig fields, problems) of config.json `c` of class `arch` (DEEPSEEK_V3 or QWEN3_MOE).
    The bias's update speed is training's, not the architecture's (DeepSeek-V3 section 2.1.2: 0.001,
    then 0): left at 0 for the user to set."""
    found: list[str] = []
    if arch == DEEPSEEK_V3:
        out = {
            "experts": _read(c, "n_routed_experts", int, found),
            "top_k": _read(c, "num_experts_per_tok", int, found),
            "moe_ffn": _read(c, "moe_intermediate_size", int, found),
            "shared_experts": _read(c, "n_shared_experts", int, found, 0),
            "norm_topk_prob": bool(c.get("norm_topk_prob", True)),
            # HF's DeepseekV3TopkRouter always scores with a sigmoid and a correction bias ('noaux_tc')
            "router": "sigmoid",
            "n_group": _read(c, "n_group", int, found, 1),
            "topk_group": _read(c, "topk_group", int, found, 1),
            "routed_scaling_factor": float(_read(c, "routed_scaling_factor", float, found, 1.0)),
            "dense_layers": _read(c, "first_k_dense_replace", int, found, 0),
        }
        method = c.get("topk_method") or "noaux_tc"  # transformers writes null
        if method != "noaux_tc":  # DeepSeek-V2's 'greedy' / 'group_limited_greedy' softmax routers
            found.append(f"topk_method={method!r} is not built: labkit routes as DeepSeek-V3 ('noaux_tc')")
        return out, found
    if arch == QWEN3_MOE:
        out = {
            # the released config.json says num_experts; transformers 5 writes num_local_experts (its attribute_map)
            "experts": _read(c, "num_experts" if "num_experts" in c else "num_local_experts", int, found),
            "top_k": _read(c, "num_experts_per_tok", int, found),
            "moe_ffn": _read(c, "moe_intermediate_size", int, found),
            "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
        }
        if c.get("mlp_only_layers"):
            found.append(
                f"mlp_only_layers={c['mlp_only_layers']} is not built: labkit's dense layers are the first "
                "ones (dense_layers); give mlp_only_layers=[]"
            )
        if c.get("decoder_sparse_step", 1) != 1:
            found.append(f"decoder_sparse_step={c['decoder_sparse_step']} is not built: every layer is MoE (1)")
        return out, found
    return {}, [f"{arch} has no fine-grained MoE fields labkit reads; use {DEEPSEEK_V3} or {QWEN3_MOE}"]
