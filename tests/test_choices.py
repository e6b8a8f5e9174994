"""Choices as types: every choice field of the configs is a `Literal`, checked when the config is
built, and decoded once (labkit/config/choices.py); nothing else in labkit/, engines/ or widgets/
compares a choice with a string (read off the source with `ast`, as tests/test_layers.py reads
the ladder). And bad input refused at the door: each wrong type or range a ConfigError at
construction (or at the call), naming the field, the value and a fix."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import typing

import pytest

from labkit import ConfigError, ModelConfig, OptimConfig, ParallelConfig, theory
from labkit.config import CHECKPOINTING, SCHEDULES, SHARDINGS, RunSpec, choices
from labkit.config.choices import Recomputation, pipeline_shape, recomputation, sharded
from labkit.layout import schedules
from labkit.theory.planner import search

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("labkit", "engines", "widgets")
DECODES = tuple(ROOT / "labkit" / "config" / f for f in ("choices.py", "float8.py", "norms.py", "optimizers.py"))
"""The modules where the choices' names are compared (matched): their decode (fp8's recipe apart)."""
CHOICE_FIELDS = {
    "sharding",
    "schedule",
    "impl",
    "precision",
    "fp8_recipe",
    "checkpoint_activations",
    "recompute",
    "arch",
    "loss",
    "router",
    "data",
}
"""Every choice field of the configs (and `recompute`, checkpoint_activations by name)."""


def _field(node: ast.AST) -> str | None:
    """The choice field a node reads: `x.sharding`, `sharding`, `d["sharding"]`, `d.get("sharding")`."""
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        name = node.slice.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        name = getattr(node.args[0], "value", None)
    else:
        return None
    return name if name in CHOICE_FIELDS else None


def _names(node: ast.AST) -> bool:
    """A str constant, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def string_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison of a choice field with a name (or names), and every match
    on one: a decode of its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(
                (_field(a) and _names(b)) or (_field(b) and _names(a)) for a, b in zip(sides, sides[1:], strict=False)
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and _field(node.subject):
            found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
    return found


def test_no_choice_is_compared_with_a_string_outside_its_decode():
    wrong = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in DECODES:
                continue
            for line, code in string_comparisons(path.read_text()):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {code}")
    assert not wrong, "read the config's decoded properties (labkit/config/choices.py) instead:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "snippet",
    [
        'cfg.sharding == "zero2"',
        'x.schedule in ("gpipe", "1f1b")',
        'cfg.impl != "lab"',
        'model.arch == "llama"',
        'precision == "bf16"',
        '"fused" == m.loss',
        'run.data not in ["text"]',
        'cfg.recompute in {"full", "op"}',
        'layout.get("checkpoint_activations") == "op"',
        'fields["arch"] == "gpt2"',
        "match cfg.sharding:\n    case 'none': pass",
    ],
)
def test_the_reader_finds_a_comparison(snippet):
    """The test above can fail: each of these is found."""
    assert string_comparisons(snippet), snippet


@pytest.mark.parametrize(
    "snippet", ["cfg.sharded.stage == 2", "cfg.sharding in SHARDINGS", "kind == 'colwise'", "cfg.tp > 1"]
)
def test_the_reader_lets_decoded_and_other_comparisons_be(snippet):
    assert not string_comparisons(snippet), snippet


def test_the_decode_module_is_the_one_that_matches():
    # 10: sigmoid_router joined them; 11: float8_scaling; 12: norm_kind; 13, 14: optimizer_kind, muon_lr_ratio
    matches = [n for path in DECODES for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Match)]
    assert len(matches) == 14


# -- the types -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ParallelConfig, ModelConfig, RunSpec])
def test_every_choice_field_is_a_literal_with_a_docstring(cls):
    hints = typing.get_type_hints(cls)
    source = pathlib.Path(__import__(cls.__module__, fromlist=["_"]).__file__).read_text()
    for f in dataclasses.fields(cls):
        if f.name in CHOICE_FIELDS:
            assert typing.get_origin(hints[f.name]) is typing.Literal, f.name
            assert f"    {f.name}: " in source and '"""' in source.split(f"    {f.name}: ")[1].splitlines()[1], f.name


def test_each_list_of_choices_is_defined_once():
    assert schedules.SCHEDULES is SCHEDULES  # the layout reads the config's list
    assert CHECKPOINTING == (False, True, "full", "selective", "op")
    # the planner's is the order it tries them in, 'full' spelled True: a subset, named for that
    assert set(search.TRIED_CHECKPOINTING) <= set(CHECKPOINTING) and "full" not in search.TRIED_CHECKPOINTING
    for values, decode in [
        (SHARDINGS, sharded),
        (SCHEDULES, pipeline_shape),
        (choices.IMPLS, choices.torch_impl),
        (choices.PRECISIONS, choices.numerics),
        (CHECKPOINTING, recomputation),
        (choices.ARCHS, choices.family),
        (choices.LOSSES, choices.fused_loss),
        (choices.DATA, choices.trains_on_text),
    ]:
        for v in values:
            decode(v)  # every value has its case
        with pytest.raises(ConfigError, match="is not one of"):
            decode("nonsense")


def test_the_decoded_properties():
    assert [ParallelConfig(sharding=s).sharded.stage for s in SHARDINGS] == [0, 1, 2, 3, 3]
    assert [ParallelConfig(sharding=s).reshards for s in SHARDINGS] == [False, False, False, True, True]
    assert not ParallelConfig(sharding="fsdp", reshard_after_forward=False).reshards
    assert [s for s in SCHEDULES if pipeline_shape(s).splits_backward] == ["zbh1", "zbv", "dualpipev"]
    assert [s for s in SCHEDULES if pipeline_shape(s).v_shaped] == ["zbv", "dualpipev"]
    assert ParallelConfig(impl="torch").torch_impl and not ParallelConfig().torch_impl
    assert [ParallelConfig(precision=p).numerics.mixed for p in ("fp32", "bf16", "fp8")] == [False, True, True]
    assert [recomputation(v).mode for v in CHECKPOINTING] == ["none", "full", "full", "selective", "op"]
    r: Recomputation = ParallelConfig(checkpoint_activations="op").recomputation
    assert r.reruns_forward and r.per_op and not r.attention_only and not r.keeps_input_only
    llama, gpt2 = ModelConfig(arch="llama").family, ModelConfig(arch="gpt2").family
    assert llama.rms_norm and llama.rotary and llama.gated_mlp and not llama.biases
    assert gpt2.biases and gpt2.ties and gpt2.gelu_approximate == "tanh"
    assert ModelConfig(loss="fused").fused_loss and RunSpec(data="text").trains_on_text


def test_the_dict_that_crosses_holds_the_fields_only():
    cfg = ParallelConfig(dp=2, sharding="zero2", schedule="zbv", precision="bf16", checkpoint_activations=True)
    d = cfg.to_dict()
    assert set(d) <= {f.name for f in dataclasses.fields(ParallelConfig)}
    assert ParallelConfig.from_dict(json.loads(json.dumps(d))) == cfg


# -- inputs refused at the door --------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(hidden="64"), "ModelConfig.hidden='64' must be a whole number"),
        (dict(heads=0), "heads=0 must be a positive integer; try heads=4"),
        (dict(layers=-2), "layers=-2 must be >= 0; try layers=4"),
        (dict(seq=-5), "seq=-5 must be a positive integer; try seq=64"),
        (dict(rope_theta=-1), "rope_theta=-1 must be > 0; RoPE's base: try 10000.0"),
        (dict(layers=True), "ModelConfig.layers=True must be a whole number (int); the default is 4"),
        (dict(vocab=256.0), "ModelConfig.vocab=256.0 must be a whole number"),
        (dict(norm_eps=float("nan")), "ModelConfig.norm_eps=nan must be a finite number"),
        (
            dict(arch="mistral"),
            "arch='mistral' is not one of ['gpt', 'gpt2', 'llama', 'deepseek_v3', 'gemma3', 'gpt_oss']",
        ),
        (dict(loss="fast"), "loss='fast' is not one of ['fp32', 'fused']"),
        (dict(kv_heads=0), "kv_heads=0 must be >= 1, or None"),
        (dict(top_k=0), "top_k=0 must be a positive integer"),
        (dict(tie_embeddings="yes"), "ModelConfig.tie_embeddings='yes' must be True or False or None"),
        (dict(rope_scaling={"factor": 0.0}), "rope_scaling.factor=0.0 must be > 0; try 8.0"),
    ],
)
def test_a_bad_model_is_refused_when_built(fields, says):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**fields)
    assert any(says in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize(
    "fields, says",
    [
        (dict(dp="2"), "ParallelConfig.dp='2' must be a whole number"),
        (dict(tp=0), "tp=0 must be a positive integer; try 1"),
        (dict(pp=True), "ParallelConfig.pp=True must be a whole number"),
        (dict(sharding="zero4"), "sharding='zero4' is not one of ['none', 'zero1', 'zero2', 'zero3', 'fsdp']"),
        (dict(schedule="zb"), "schedule='zb' is not one of"),
        (dict(impl="jax"), "impl='jax' is not one of ['lab', 'torch']"),
        (dict(precision="fp16"), "precision='fp16' is not one of ['fp32', 'bf16', 'fp8']"),
        (dict(checkpoint_activations=1), "checkpoint_activations=1 is not one of"),  # 1 is not True
        (dict(checkpoint_activations="none"), "pick one of those (True is 'full')"),
        (dict(sequence_parallel=1), "ParallelConfig.sequence_parallel=1 must be True or False"),
        (dict(virtual_stages=0), "virtual_stages=0 must be a positive integer"),
        (dict(stage_layers=(2, -1)), "stage_layers=(2, -1) must hold whole numbers >= 0"),
        (dict(stage_layers=(2.0,)), "must be a tuple of whole numbers"),
        (dict(order="dp-tp"), "order='dp-tp' must name each of tp-cp-ep-dp-pp exactly once"),
        (dict(bucket_mb=float("inf")), "ParallelConfig.bucket_mb=inf must be a finite number"),
        (dict(global_batch=0), "global_batch=0 must be a positive integer; try 8"),
    ],
)
def test_a_bad_layout_is_refused_when_built(fields, says):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**fields)
    assert any(says in p for p in e.value.problems), e.value.problems


def test_a_config_built_before_lets_no_lookalike_in():
    """check_fields remembers the configs that passed; 1 == True and (2, 2) == (2.0, 2.0), yet the
    lookalikes are refused."""
    ParallelConfig(pp=2, stage_layers=(2, 2), sequence_parallel=False)
    with pytest.raises(ConfigError, match="must be a tuple of whole numbers"):
        ParallelConfig(pp=2, stage_layers=(2.0, 2.0), sequence_parallel=False)
    with pytest.raises(ConfigError, match="sequence_parallel=0 must be True or False"):
        ParallelConfig(pp=2, stage_layers=(2, 2), sequence_parallel=0)
    ModelConfig(layers=1)
    with pytest.raises(ConfigError, match="layers=True must be a whole number"):
        ModelConfig(layers=True)


def test_replace_and_from_dict_are_checked_too():
    with pytest.raises(ConfigError, match="sharding='zero4'"):
        ParallelConfig().replace(sharding="zero4")
    with pytest.raises(ConfigError, match="model heads=0"):
        ModelConfig.from_dict({"heads": 0})
    with pytest.raises(ConfigError, match="data='txt' is not one of"):
        RunSpec(data="txt")
    with pytest.raises(ConfigError, match="data='txt' is not one of"):
        RunSpec.from_dict({"data": "txt"})


@pytest.mark.parametrize("call", [theory.estimate, theory.evaluate])
def test_swapped_arguments_say_so(call):
    name = call.__name__
    with pytest.raises(ConfigError, match=rf"{name}\(cfg, model\) .* swapped; call {name}\(cfg, model\)"):
        call(ModelConfig(), ParallelConfig())
    with pytest.raises(ConfigError, match="takes a ParallelConfig and a ModelConfig, not a dict"):
        call({"dp": 2}, ModelConfig())


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


def test_from_hf_names_a_missing_or_mistyped_key():
    assert ModelConfig.from_hf(LLAMA).hidden == 64
    missing = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match="config.json has no 'num_hidden_layers'"):
        ModelConfig.from_hf(missing)
    with pytest.raises(ConfigError, match="config.json's 'hidden_size' is '64', not a JSON whole number"):
        ModelConfig.from_hf({**LLAMA, "hidden_size": "64"})
    with pytest.raises(ConfigError, match="config.json's 'rms_norm_eps' is 'small', not a JSON number"):
        ModelConfig.from_hf({**LLAMA, "rms_norm_eps": "small"})
    with pytest.raises(ConfigError, match="'rope_scaling.factor'"):
        ModelConfig.from_hf({**LLAMA, "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 64}})
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}
    with pytest.raises(ConfigError, match="config.json has no 'n_layer'"):
        ModelConfig.from_hf(gpt2)


def test_from_hf_reads_local_files_only(tmp_path):
    with pytest.raises(ConfigError, match=r"from_hf\(None\): no config given"):
        ModelConfig.from_hf(None)
    with pytest.raises(ConfigError, match="not a int"):
        ModelConfig.from_hf(3)
    hub = "meta-llama/Llama-3.2-1B"
    with pytest.raises(ConfigError, match="labkit reads a local config.json or a dict and never downloads") as e:
        ModelConfig.from_hf(hub)
    assert f"hf_hub_download('{hub}', 'config.json')" in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(tmp_path / "config.json")  # a model's folder
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="is not a readable JSON file"):
        ModelConfig.from_hf(tmp_path / "bad.json")


def test_optim_is_checked_once_by_the_lab():
    """Lab.run asks optim_problems once (it was twice): the source says so."""
    source = (ROOT / "labkit" / "cluster" / "lab.py").read_text()
    assert source.count("optim_problems(optim)") == 1
    assert OptimConfig(lr=0) is not None  # an OptimConfig is still checked by the Lab, not when built


def test_every_sharding_has_its_row_in_each_place_that_reads_it():
    """The shardings' registry (choices.sharded, zero_stages): a value added to Sharding without its decode, or
    a stage without its model states, its column in the ZeRO figure or the planner's rule, fails here."""
    from labkit import theory
    from labkit.config.choices import zero_stages
    from labkit.theory.planner.search import searched
    from labkit.widgets.theory_figures import STAGES

    assert sorted(zero_stages()) == [0, 1, 2, 3]
    states = theory.model_state_bytes(1000, 4, "bf16")
    assert tuple(states) == STAGES == tuple(zero_stages().values())
    for s in SHARDINGS:
        sh = sharded(s)
        assert zero_stages()[sh.stage] in states, s
        assert {searched(sh, pp) for pp in (1, 2)} <= {True, False}, s
    # the paper's figure 1, Psi = 1000, N_d = 4, K = 12: each stage's total
    assert [states[s]["total"] for s in STAGES] == [16000, 4000 + 3000, 2000 + 3500, 4000]
