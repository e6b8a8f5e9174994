"""The fine-grained MoE fields of ModelConfig (moe_ffn ... bias_update_speed) checked against each
other, with a fix for each problem (validation.py `problems` calls it): group-limited routing's
groups must split the experts and hold the top-k, the bias's update needs the sigmoid router."""

from __future__ import annotations


def moe_problems(model) -> list[str]:
    """The fine-grained MoE fields (ModelConfig.moe_ffn ... bias_update_speed) against each other."""
    out = []
    e, g = model.experts, model.n_group
    if g > 1 and (not e or e % g):
        out.append(f"n_group={g} must divide experts={e} (group-limited routing); try n_group=1")
    elif g > 1 and e // g < 2:
        # a group's score is the sum of its two best experts (DeepSeek-V3; HF DeepseekV3TopkRouter)
        out.append(f"n_group={g} leaves {e // g} expert(s) a group; a group scores its best two: n_group <= {e // 2}")
    if g > 1 and not 1 <= model.topk_group <= g:
        out.append(f"topk_group={model.topk_group} must be between 1 and n_group={g}")
    elif g > 1 and model.top_k > model.topk_group * (e // g):
        out.append(
            f"top_k={model.top_k} exceeds the {model.topk_group * (e // g)} experts of topk_group={model.topk_group} "
            f"groups; raise topk_group"
        )
    if model.experts and model.dense_layers > model.layers:
        out.append(f"dense_layers={model.dense_layers} exceeds layers={model.layers}")
    if model.bias_update_speed and not model.sigmoid_router:
        out.append("bias_update_speed > 0 needs router='sigmoid' (DeepSeek-V3's aux-loss-free bias)")
    return out


def moe_layout_problems(cfg, model) -> list[str]:
    """What a layout cannot do with these fields yet, with the reason."""
    if cfg.recomputation.per_op and model.experts and model.dense_layers:
        # the 'op' policy keeps every second matmul's output: a dense block keeps more than an MoE block,
        # and theory/exact/activations.py prices one kind of block per chunk under it
        return [
            "checkpoint_activations='op' with dense_layers > 0 is not priced (a dense block keeps other "
            "matmuls than an MoE block under the per-op policy); use 'full' or 'selective'"
        ]
    return []
