"""ModelConfig.from_hf on the published Hugging Face configs (tests/data/hf_configs.py), the exact
presets and their published parameter counts, the families' parameter lists, and RoPE with
Llama 3.1's scaling. No cluster, no network."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from labkit import ConfigError, ModelConfig, ParallelConfig, theory, validate
from labkit.theory.presets import PRESETS, PUBLISHED_PARAMS

sys.path.insert(0, str(Path(__file__).parent / "data"))
from hf_configs import MISTRAL_7B_V01, OTHER_COUNTS, PRESET_CONFIGS, QWEN2_05B  # noqa: E402


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_hold_the_published_exact_counts(name):
    assert theory.num_params(PRESETS[name]) == PRESETS[name].num_params() == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", list(PRESET_CONFIGS))
def test_from_hf_is_the_preset(name, tmp_path):
    preset = PRESETS[name]
    model = ModelConfig.from_hf(PRESET_CONFIGS[name], seq=preset.seq)
    assert model == preset
    assert theory.num_params(model) == PUBLISHED_PARAMS[name]
    path = tmp_path / "config.json"  # a path works as the dict does
    path.write_text(json.dumps(PRESET_CONFIGS[name]))
    assert ModelConfig.from_hf(path, seq=preset.seq) == preset


@pytest.mark.parametrize("name", list(OTHER_COUNTS))
def test_from_hf_counts_other_published_models(name):
    config, count = OTHER_COUNTS[name]
    assert theory.num_params(ModelConfig.from_hf(config)) == count


def test_qwen2_has_biases_on_q_k_v_only():
    m = ModelConfig.from_hf(QWEN2_05B, seq=4096)
    assert (m.arch, m.qkv_bias, m.tied, m.n_kv_heads, m.norm_eps) == ("llama", True, True, 2, 1e-6)
    biases = [n for n, _ in theory.param_shapes(m) if n.endswith("bias")]
    assert {n.split(".")[-2] for n in biases} == {"wq", "wk", "wv"}


def test_from_hf_reads_the_families():
    gpt2 = ModelConfig.from_hf(PRESET_CONFIGS["gpt2-124m"])
    assert (gpt2.arch, gpt2.tied, gpt2.seq, gpt2.ffn) == ("gpt2", True, 1024, 3072)
    llama = ModelConfig.from_hf(PRESET_CONFIGS["llama3.1-8b"])
    assert llama.seq == 131072 and llama.rope_scaling.factor == 8.0 and llama.rope_theta == 5e5
    mixtral = ModelConfig.from_hf(PRESET_CONFIGS["mixtral-8x7b"])
    assert (mixtral.experts, mixtral.top_k, mixtral.n_kv_heads) == (8, 2, 8)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 256}, "head_dim"),
        ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, "architectures"),
    ],
)
def test_from_hf_refuses_what_it_does_not_build_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf({**PRESET_CONFIGS["llama3.1-8b"], **change})


def test_mistral_window_is_built_when_the_sequence_exceeds_it():
    # sliding windows are built (every Mistral layer local); within the window it changes nothing
    m = ModelConfig.from_hf(MISTRAL_7B_V01)
    assert (m.seq, m.sliding_window, m.window_pattern, m.layer_window(0)) == (32768, 4096, 0, 4096)
    assert ModelConfig.from_hf(MISTRAL_7B_V01, seq=4096).sliding_window is None


def test_family_defaults_stay_unset_and_round_trip():
    gpt2 = ModelConfig(arch="gpt2")
    assert gpt2.tied and gpt2.tie_embeddings is None and gpt2.n_kv_heads == gpt2.heads
    assert not gpt2.replace(arch="llama").tied  # nothing stale carried over
    for m in PRESETS.values():
        assert ModelConfig.from_dict(m.to_dict()) == m
    assert ModelConfig.from_dict(json.loads(json.dumps(PRESETS["llama-405b"].to_dict()))) == PRESETS["llama-405b"]


def test_validation_of_families_names_the_numbers():
    llama = PRESETS["llama3.1-8b"]
    validate(ParallelConfig(tp=16), llama, engines=16)  # 16 > 8 KV heads: each shared by 2 tp ranks
    with pytest.raises(ConfigError, match="tp=16 > kv_heads=8.*DTensor"):
        validate(ParallelConfig(tp=16, impl="torch"), llama, engines=16)
    with pytest.raises(ConfigError, match=r"kv_heads=3 must divide heads=32"):
        validate(ParallelConfig(), llama.replace(kv_heads=3))
    with pytest.raises(ConfigError, match="rope_theta / rope_scaling apply to arch='llama'"):
        validate(ParallelConfig(), ModelConfig(rope_theta=5e5))


def test_stage_layers_are_checked_with_their_numbers():
    m = PRESETS["llama-405b"]
    ok = ParallelConfig(pp=8, stage_layers=(15, 16, 16, 16, 16, 16, 16, 15))
    validate(ok, m, engines=8)
    with pytest.raises(ConfigError, match=r"stage_layers=\(16, 16, 16, 16, 16, 16, 16, 15\) sums to 127"):
        validate(ok.replace(stage_layers=(16,) * 7 + (15,)), m, engines=8)
    with pytest.raises(ConfigError, match=r"has 8 entries, but pp\(8\) \* virtual_stages\(2\) = 16"):
        validate(ok.replace(virtual_stages=2, schedule="interleaved", microbatches=8), m, engines=8)
    with pytest.raises(ConfigError, match=r"stage_layers=\(16, 16, 16, 16, 16, 16, 15, 15\)"):
        validate(ParallelConfig(pp=8), m, engines=8)  # the refusal offers an uneven split


def test_llama3_rope_scaling_matches_the_published_formula():
    """Meta's apply_scaling (llama-models, reference code), transcribed with math on plain floats."""
    torch = pytest.importorskip("torch")
    from labkit.engines.layers import rope_frequencies

    m = PRESETS["llama3.1-8b"]
    got = rope_frequencies(m).tolist()
    want = []
    for i in range(0, m.head_dim, 2):
        f = 1.0 / m.rope_theta ** (i / m.head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    assert got == pytest.approx(want, rel=1e-6)
    assert got[0] == pytest.approx(1.0) and got[-1] == pytest.approx(want[-1])
    assert torch.is_tensor(rope_frequencies(m.replace(rope_scaling=None)))


@pytest.mark.parametrize(
    "model",
    [
        ModelConfig(arch="gpt2", layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16),
        ModelConfig(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16),
        ModelConfig(
            arch="llama",
            layers=2,
            hidden=32,
            heads=4,
            kv_heads=1,
            ffn=32,
            vocab=128,
            seq=16,
            experts=4,
            top_k=2,
            tie_embeddings=True,
            qkv_bias=True,
        ),
    ],
)
def test_theory_lists_every_parameter_of_each_family(model):
    pytest.importorskip("torch")
    from labkit.engines.model import build_model

    net = build_model(model, 0)
    assert [(n, tuple(p.shape)) for n, p in net.named_parameters()] == list(theory.param_shapes(model))
    assert sum(p.numel() for p in net.parameters()) == theory.num_params(model) == model.num_params()
