"""Fine-grained MoE: Qwen3-MoE's and DeepSeek-V3's MoE layer against
transformers' own modules on the same weights, its parameters against transformers' models of the
published sizes (meta device), the aux-loss-free bias against the oracle, and layouts on the
4-engine cluster against the one-process reference, with model-state and comm bytes against the theory."""

from __future__ import annotations

import pytest
import torch

from labkit import ConfigError, ModelConfig, ParallelConfig, reference, theory, validate
from labkit.config.hf.moe import DEEPSEEK_V3, QWEN3_MOE, moe_fields
from labkit.engines.model import build_model
from labkit.engines.moe import MoE, update_expert_bias
from labkit.oracle.checks import assert_matches, buffers
from labkit.theory.exact.experts import moe_layers_held

transformers = pytest.importorskip("transformers")

DSV3 = ModelConfig(
    layers=4, hidden=32, heads=4, ffn=64, vocab=128, seq=16, arch="llama", experts=8, top_k=3, moe_ffn=16,
    shared_experts=1, norm_topk_prob=True, router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
    dense_layers=1, bias_update_speed=0.01, aux_loss_coef=0.001,
)  # fmt: skip
"""A DeepSeek-V3-shaped toy: a dense first block, then 8 routed experts (top-3 within 2 of 4 groups) + 1 shared."""
QWEN3 = ModelConfig(
    layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16, arch="llama", experts=8, top_k=2, moe_ffn=24,
    norm_topk_prob=False,
)  # fmt: skip
"""Qwen3-MoE's layer: softmax top-k, gates not renormalised, experts narrower than the dense ffn."""


def _load_experts(ours: MoE, hf_experts, f: int) -> None:
    """transformers' fused (E, 2f, h) gate_up_proj and (E, h, f) down_proj -> our w1, w3 (E, h, f), w2 (E, f, h)."""
    with torch.no_grad():
        ours.w1.copy_(hf_experts.gate_up_proj[:, :f, :].transpose(1, 2))
        ours.w3.copy_(hf_experts.gate_up_proj[:, f:, :].transpose(1, 2))
        ours.w2.copy_(hf_experts.down_proj.transpose(1, 2))


def _hf_moe(kind: str, m: ModelConfig):
    from transformers import AutoConfig

    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        c = AutoConfig.for_model(
            "deepseek_v3", hidden_size=m.hidden, moe_intermediate_size=m.moe_ffn, n_routed_experts=m.experts,
            num_experts_per_tok=m.top_k, n_shared_experts=m.shared_experts, n_group=m.n_group,
            topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor, norm_topk_prob=m.norm_topk_prob,
        )  # fmt: skip
        return DeepseekV3MoE(c)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    c = AutoConfig.for_model(
        "qwen3_moe", hidden_size=m.hidden, moe_intermediate_size=m.moe_ffn, num_experts=m.experts,
        num_experts_per_tok=m.top_k, norm_topk_prob=m.norm_topk_prob,
    )  # fmt: skip
    return Qwen3MoeSparseMoeBlock(c)


LAYERS = [("deepseek_v3", DSV3), ("qwen3_moe", QWEN3), ("qwen3_moe", QWEN3.replace(norm_topk_prob=True))]


@pytest.mark.parametrize("kind, m", LAYERS)
def test_the_moe_layer_is_transformers_own(kind, m):
    """Our MoE layer and transformers' DeepseekV3MoE / Qwen3MoeSparseMoeBlock on the same weights give the
    same outputs; for DeepSeek-V3 with a bias that changes the choice (and the group limit biting)."""
    torch.manual_seed(0)
    hf = _hf_moe(kind, m).float()
    ours = build_model(m, 0).blocks[m.dense_layers].mlp
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        _load_experts(ours, hf.experts, m.expert_ffn)
        ours.router.weight.copy_(hf.gate.weight)
        if kind == "deepseek_v3":
            hf.gate.e_score_correction_bias.copy_(torch.randn(m.experts, generator=gen) * 0.3)
            ours.expert_bias.copy_(hf.gate.e_score_correction_bias)
            for name in ("gate", "up", "down"):
                getattr(ours.shared, name).weight.copy_(getattr(hf.shared_experts, name + "_proj").weight)
    x = torch.randn(3, m.seq, m.hidden, generator=gen)
    want, got = hf(x), ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if kind == "deepseek_v3":  # the bias changed the choice: without it the output differs
        with torch.no_grad():
            ours.expert_bias.zero_()
        assert (ours(x) - want).abs().max() > 1e-2


def _hf_mlp_params(kind: str, **kw) -> int:
    """Parameters of the MLPs (dense, routed, shared, routers) of transformers' model of `kind` on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    c = AutoConfig.for_model(kind, **kw)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(c)
    return sum(p.numel() for n, p in net.named_parameters() if ".mlp." in n), c


def _our_mlp_params(m: ModelConfig) -> int:
    return sum(torch.Size(s).numel() for n, s in theory.param_shapes(m) if ".mlp." in n)


QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    vocab_size=151936, max_position_embeddings=40960, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
"""Qwen3-30B-A3B's config.json (huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json)."""
DEEPSEEK_V3_671B = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, n_routed_experts=256,
    num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    first_k_dense_replace=3, norm_topk_prob=True, vocab_size=129280,
)  # fmt: skip
"""DeepSeek-V3's config.json (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json; transformers'
DeepseekV3Config defaults are the same)."""


PUBLISHED = [("qwen3_moe", QWEN3_MOE, QWEN3_30B_A3B), ("deepseek_v3", DEEPSEEK_V3, DEEPSEEK_V3_671B)]


@pytest.mark.parametrize("kind, arch, published", PUBLISHED)
def test_published_moe_parameters_equal_transformers(kind, arch, published):
    """Every MLP parameter (dense first layers, routed and shared experts, routers) of the published sizes,
    read by moe_fields, equals transformers' model built on the meta device; the attention is the other parts'."""
    hf, c = _hf_mlp_params(kind, **published)
    fields, found = moe_fields(c.to_dict(), arch)
    assert found == []
    m = ModelConfig(
        layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads, ffn=c.intermediate_size,
        vocab=c.vocab_size, seq=64, arch="llama", **fields,
    )  # fmt: skip
    assert _our_mlp_params(m) == hf
    if kind == "deepseek_v3":  # 58 MoE layers of 256 x 3 x 7168 x 2048 + shared + router; 3 dense of 3 x 7168 x 18432
        assert hf == 58 * (256 * 3 * 7168 * 2048 + 3 * 7168 * 2048 + 256 * 7168) + 3 * 3 * 7168 * 18432


def test_unbuilt_moe_fields_are_refused_by_name():
    base = {"num_experts_per_tok": 2, "moe_intermediate_size": 8}
    _, found = moe_fields({**base, "num_experts": 8, "mlp_only_layers": [0]}, QWEN3_MOE)
    assert any("mlp_only_layers" in f for f in found)
    _, found = moe_fields({**base, "n_routed_experts": 8, "topk_method": "greedy"}, DEEPSEEK_V3)
    assert any("topk_method" in f for f in found)
    with pytest.raises(ConfigError, match="n_group=3 must divide experts=8"):
        validate(ParallelConfig(), DSV3.replace(n_group=3), 1)
    with pytest.raises(ConfigError, match="exceeds the 4 experts"):
        validate(ParallelConfig(), DSV3.replace(top_k=5), 1)
    with pytest.raises(ConfigError, match="checkpoint_activations='op' with dense_layers"):
        validate(ParallelConfig(checkpoint_activations="op"), DSV3, 1)
    with pytest.raises(ConfigError, match="bias_update_speed"):
        validate(ParallelConfig(), QWEN3.replace(bias_update_speed=0.1), 1)


def test_the_bias_moves_towards_balance_from_the_global_loads():
    """After one step every bias moved by ±γ (centred): up for the experts under the mean load, down over it;
    a bias updated from half the batch's loads is not the oracle's (the buffers check has teeth)."""
    ref = reference(DSV3, steps=1)
    net = build_model(DSV3, 0)
    from labkit.engines import data

    tokens, targets = data.global_batch(0, 0, 8, DSV3.seq, DSV3.vocab)
    net(tokens, targets)
    loads = {i: m.loads.clone() for i, m in enumerate(net.blocks) if isinstance(m.mlp, MoE) for m in [m.mlp]}
    update_expert_bias(net.modules())
    for i, load in loads.items():
        bias = net.blocks[i].mlp.expert_bias
        sign = torch.sign(load.float().mean() - load.float())
        torch.testing.assert_close(bias, 0.01 * (sign - sign.mean()))
        torch.testing.assert_close(torch.from_numpy(ref.buffers[f"blocks.{i}.mlp.expert_bias"]), bias)
    half = build_model(DSV3, 0)
    half(tokens[:4], targets[:4])  # one data rank's loads, never summed with the other's
    update_expert_bias(half.modules())

    from types import SimpleNamespace

    run = lambda m: SimpleNamespace(
        buffers={n: b.numpy() for n, b in m.named_buffers()}, config=ParallelConfig(), steps=1
    )
    assert buffers(run(half), ref, 1e-6)  # the check fails a bias from half the batch's loads ...
    assert not buffers(run(net), ref, 1e-6)  # ... and passes the whole batch's


VARIANTS = {
    "mixtral": {},
    "moe_ffn": dict(moe_ffn=16),
    "no-renorm": dict(norm_topk_prob=False, routed_scaling_factor=2.5),
    "shared x2": dict(shared_experts=2, moe_ffn=16),
    "sigmoid": dict(router="sigmoid"),
    "sigmoid, 4 groups": dict(router="sigmoid", n_group=4, topk_group=2, norm_topk_prob=False),
    "softmax, 2 groups": dict(n_group=2, topk_group=1),
    "gpt, renorm, shared": dict(arch="gpt", norm_topk_prob=True, shared_experts=1),
}


@pytest.mark.parametrize("kw", VARIANTS.values(), ids=list(VARIANTS))
def test_what_the_layer_keeps_is_the_theory(kw):
    """The bytes an MoE layer saves for backward, measured by the saved-tensor meter, equal
    layer_activation_bytes for every routing variant (one process: R = N)."""
    from labkit.engines.meters.memory import MemoryMeter
    from labkit.theory.exact.experts import layer_activation_bytes

    kw = {"arch": "llama", **kw}
    m = ModelConfig(layers=1, hidden=32, heads=4, ffn=64, vocab=128, seq=16, experts=8, top_k=4, **kw)
    layer = MoE(m)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(3, m.seq, m.hidden, generator=gen, requires_grad=True)
    meter = MemoryMeter()
    meter.exclude([*layer.parameters(), x])
    with meter.saved_tensors():
        y = layer(x)  # kept: the graph (and what it saved) lives while y does
    assert meter.live["activations"] == layer_activation_bytes(m, 3, m.seq)
    del y


def test_the_whole_model_keeps_what_the_theory_says():
    """Dense first block + MoE blocks with shared experts and the sigmoid router: parameters and saved bytes."""
    from test_experts import check_parameters_and_activations

    check_parameters_and_activations(DSV3)


LAYOUTS = [
    ParallelConfig(dp=4),
    ParallelConfig(dp=4, sharding="zero3"),
    ParallelConfig(dp=2, tp=2, sequence_parallel=True, sharding="fsdp"),
    ParallelConfig(pp=2, dp=2, microbatches=2),
    ParallelConfig(cp=2, ep=2),
    ParallelConfig(ep=4),
    ParallelConfig(ep=2, dp=2, checkpoint_activations=True),
    ParallelConfig(tp=2, ep=2, sequence_parallel=True),
    ParallelConfig(pp=2, ep=2, sharding="zero1", microbatches=2),
    ParallelConfig(pp=2, ep=2, microbatches=4, schedule="interleaved", virtual_stages=2),
    ParallelConfig(ep=2, dp=2, precision="bf16"),
    ParallelConfig(dp=4, sharding="fsdp", impl="torch"),
]
IDS = ["dp4", "zero3", "fsdp-tp2-sp", "pp2-dp2", "cp2-ep2", "ep4", "ep2-dp2-recompute", "tp2-sp-ep2", "pp2-ep2-zero1"]
IDS += ["pp2-ep2-interleaved", "ep2-dp2-bf16", "fsdp2-torch"]


@pytest.mark.parametrize("cfg", LAYOUTS, ids=IDS)
def test_deepseek_v3_shaped_moe_trains_like_one_process(lab, ref_cache, cfg):
    """Every strategy on the DeepSeek-V3-shaped toy matches the reference: losses, gradients, parameters
    and the routers' biases (each rank's copy equal, and equal to the reference's); every model-state
    byte, activation byte and comm row equals the theory (tests/theory_match.py: the all-to-alls per
    rank once its routing is read off its combines, exactly per ep group)."""
    from theory_match import compare

    res = lab.run(cfg, model=DSV3, steps=3, return_params=True)
    ref = ref_cache(DSV3)
    assert_matches(res, ref)
    assert sorted(res.buffers) == sorted(ref.buffers) == [f"blocks.{i}.mlp.expert_bias" for i in (1, 2, 3)]
    assert all(abs(b).max() > 0 for b in ref.buffers.values())  # the biases moved: the check compared something
    again = type(res).from_dict(res.to_dict()).buffers  # saved and loaded with the run
    assert all((again[n] == b).all() for n, b in res.buffers.items())
    compare(res, cfg, DSV3, world=4)
    # the bias's all-reduce is among the rows compared: without it the theory's all-reduces are lighter by
    # each rank's (MoE layers held, E) int64 loads a step
    still = theory.estimate(cfg, DSV3.replace(bias_update_speed=0.0), world=4).comm_table()
    for rk in res.ranks:
        held = moe_layers_held(cfg, DSV3, rk.coords["pp"])
        mine = [r for r in res.comm_table() if r["rank"] == rk.rank and r["op"] == "all_reduce"]
        less = [r for r in still if r["rank"] == rk.rank and r["op"] == "all_reduce"]
        gap = sum(r["payload_bytes"] for r in mine) - sum(r["payload_bytes"] for r in less)
        assert gap == 8 * held * DSV3.experts  # the comm table is per step


def test_uneven_stages_hold_what_the_theory_says(lab, ref_cache):
    """pp=2 over a dense first block: stage 0 (embedding, dense block, MoE block) and stage 1 (two MoE
    blocks, head) hold different bytes, each equal to the theory's."""
    cfg = ParallelConfig(pp=2, ep=2, microbatches=2)
    res = lab.run(cfg, model=DSV3, steps=2)
    est = theory.estimate(cfg, DSV3, world=4)
    params = {rk.coords["pp"]: rk.memory["params"] for rk in res.ranks}
    assert params[0] != params[1]
    assert all(rk.memory["params"] == est.memory[rk.rank]["params"] for rk in res.ranks)


@pytest.mark.parametrize("cfg", [ParallelConfig(ep=4), ParallelConfig(tp=2, ep=2, sequence_parallel=True)])
def test_qwen3_moe_shaped_layer_trains_like_one_process(lab, ref_cache, cfg):
    from theory_match import compare

    res = lab.run(cfg, model=QWEN3, steps=3, return_params=True)
    assert_matches(res, ref_cache(QWEN3))
    compare(res, cfg, QWEN3, world=4)


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(pp=2, ep=2),
        ParallelConfig(tp=2, ep=2),
        ParallelConfig(pp=4, tp=2, ep=4, stage_layers=(1, 1, 1, 1)),
    ],
    ids=["pp2-ep2", "tp2-ep2", "pp4-tp2-ep4"],
)
def test_the_planner_counts_each_stage_as_the_exact_theory(cfg):
    """The planner's closed form (stages.py: one MoE block standing for the MoE blocks, the dense first
    ones counted as theirs) holds what the exact parameter list holds, stage by stage."""
    from labkit.theory.exact.params import rank_param_count
    from labkit.theory.planner.stages import stage_params, stages

    for st in stages(cfg, DSV3):
        assert sum(stage_params(DSV3, cfg, st)) == rank_param_count(cfg, DSV3, st.rank), st


def test_the_planner_prices_deepseek_v3_moe_at_scale():
    """DeepSeek-V3's MoE (its published fields, grouped-query attention standing in for MLA until the lead
    joins it) priced on 2,048 GPUs in the report's layout, PP16 x EP64 x ZeRO-1 (arXiv:2412.19437,
    section 3.2.1): the stage holding the three dense blocks holds fewer experts than the next one."""
    from labkit.theory.planner.stages import stage_params, stages

    m = ModelConfig(
        layers=61, hidden=7168, heads=128, ffn=18432, vocab=129280, seq=4096, arch="llama", experts=256, top_k=8,
        moe_ffn=2048, shared_experts=1, norm_topk_prob=True, router="sigmoid", n_group=8, topk_group=4,
        routed_scaling_factor=2.5, dense_layers=3, kv_heads=128,
    )  # fmt: skip
    cfg = ParallelConfig(pp=16, ep=64, dp=2, sharding="zero1", microbatches=16, global_batch=2048,
                         stage_layers=(3,) + (4,) * 14 + (2,))  # fmt: skip
    from labkit.theory.exact.params import rank_param_count

    first, second = stages(cfg, m)[:2]
    (_, e0), (_, e1) = stage_params(m, cfg, first), stage_params(m, cfg, second)
    assert e0 == 0 and e1 == 4 * 256 // 64 * 3 * 7168 * 2048  # stage 0: the three dense blocks, no experts
    for st in (first, second):
        assert sum(stage_params(m, cfg, st)) == rank_param_count(cfg, m, st.rank)
    plan = theory.estimate(cfg, m, world=2048)  # the exact per-rank estimate at 2,048 ranks
    # ZeRO-1: a dense weight's AdamW moments (8 bytes) sharded over its reduce group, dp x ep = 128 ranks;
    # stage 0 holds no expert (whose moments would be sharded over dp = 2 alone)
    assert plan.memory[0]["optimizer"] == pytest.approx(8 * rank_param_count(cfg, m, 0) / 128, rel=1e-3)


def test_recomputation_counts_each_token_once():
    """A checkpointed block routes its tokens again in backward; the loads the bias reads count them once.
    (Full recomputation doubles every load alike, which sign() would not notice: this checks the counts.)"""
    from labkit.engines import data
    from labkit.engines.meters.memory import MemoryMeter
    from labkit.engines.parallel.checkpoint import apply_ac

    tokens, targets = data.global_batch(0, 0, 4, DSV3.seq, DSV3.vocab)
    plain, checkpointed = build_model(DSV3, 0), build_model(DSV3, 0)
    apply_ac(checkpointed, MemoryMeter())
    for net in (plain, checkpointed):
        net(tokens, targets).backward()
    for a, b in zip(plain.blocks[1:], checkpointed.blocks[1:]):
        assert int(a.mlp.loads.sum()) == 4 * DSV3.seq * DSV3.top_k
        assert torch.equal(a.mlp.loads, b.mlp.loads)


def _local_loads(original):
    """engines/moe.py update_expert_bias as engines/train.py calls it, with each rank's own loads
    (the all-reduce over dp x ep x cp left out)."""

    def update_expert_bias(modules, group=None):
        return original(modules, None)

    return update_expert_bias


def test_a_bias_from_one_ranks_loads_is_caught(lab, ref_cache):
    """The mutation suite's hook (tests/test_mutations.py) on the real cluster: with the loads' all-reduce
    left out, the ranks' biases part (the replicas check names the buffer) and miss the reference's."""
    from test_mutations import mutated

    from labkit.cluster.shipping import register
    from labkit.oracle.checks import margins, mismatches

    register(_local_loads)  # this module's bug goes to the engines by value, as test_mutations' do
    cfg = ParallelConfig(ep=2, dp=2)
    with mutated(lab, ("labkit.engines.train", None, "update_expert_bias"), _local_loads):
        res = lab.run(cfg, model=DSV3, steps=3, return_params=True)
    found = mismatches(res, ref_cache(DSV3))
    over = margins(res, ref_cache(DSV3))
    print(
        f"\nbias from one rank's loads: caught by {sorted({m.check for m in found})}, margins "
        + ", ".join(f"{k} {v:.3g}" for k, v in over.items())
    )
    assert {m.check for m in found} >= {"replicas", "buffers"}, found
    assert any("expert_bias" in str(m) for m in found if m.check == "replicas")
