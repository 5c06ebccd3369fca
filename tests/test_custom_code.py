"""Bring your own code: plugins, `file.py:fn` references, workflow_args and `raygraph validate`
on user files written outside the repository (every snippet of docs/custom-algorithm.md runs here)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.testing import assert_close

import raygraph
from raygraph import rewards
from raygraph.algos import advantages, losses
from raygraph.algos.user_code import import_plugin
from raygraph.config import ConfigError, build_config, load_config, to_yaml
from raygraph.config.workflow_ref import load_workflow
from raygraph.rewards import REWARDS

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "configs" / "grpo_toy.yaml"
DOC = REPO / "docs" / "custom-algorithm.md"


def doc_files() -> dict[str, str]:
    """The doc's code blocks whose first line names a file (`# my_cispo.py: ...`), by file name."""
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+?\.(?:py|yaml))\b.*?\n(.*?)```", DOC.read_text(), re.S)
    return {name: body for name, body in blocks}


def write_doc_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(doc_files()[name])
    return path


def toy_data(**changes) -> dict:
    data = yaml.safe_load(TOY.read_text())
    data.update(changes)
    return data


@pytest.fixture
def fresh_registries():
    """The registries are global: what a test's plugins register is removed afterwards."""
    saved = [(r, dict(r._entries), dict(r._info)) for r in (losses._POLICY_LOSSES, advantages._ESTIMATORS)]
    rewards = (dict(REWARDS._fns), dict(REWARDS._by_source))
    modules = set(sys.modules)
    yield
    for registry, entries, info in saved:
        registry._entries, registry._info = entries, info
    REWARDS._fns, REWARDS._by_source = rewards
    for name in set(sys.modules) - modules:
        if name.startswith("raygraph_plugin_"):
            del sys.modules[name]


# --------------------------------------------------------------------------- plugins and references


def test_the_doc_plugin_is_imported_before_the_checks_and_stored_absolute(tmp_path, monkeypatch, fresh_registries):
    write_doc_file(tmp_path, "my_cispo.py")
    fragment = yaml.safe_load(doc_files()["my_config.yaml"])
    monkeypatch.chdir(tmp_path)   # plugin paths are relative to the working directory
    with pytest.raises(ConfigError, match="actor.policy_loss='my_cispo' is not a known policy loss"):
        build_config(toy_data(actor=fragment["actor"]))
    cfg = build_config(toy_data(**fragment))
    assert cfg.plugins == [str(tmp_path / "my_cispo.py")] and cfg.actor.policy_loss == "my_cispo"
    assert "my_cispo" in losses.policy_loss_names()
    assert build_config(cfg.model_dump()).plugins == cfg.plugins   # importing twice registers once


def test_plugin_problems_are_config_problems(tmp_path):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(ConfigError) as err:
        build_config(toy_data(plugins=[str(tmp_path / "broken.py"), str(tmp_path / "absent.py"), "no_such_mod"]))
    problems = err.value.problems
    assert any(p.startswith("plugins[0]=") and "ZeroDivisionError" in p for p in problems), problems
    assert any(p.startswith("plugins[1]:") and "does not exist" in p for p in problems), problems
    assert any(p.startswith("plugins[2]:") and "cannot be imported" in p for p in problems), problems


USER_FUNCTIONS = '''
import torch
from raygraph.algos.losses import aggregate


def half_reinforce(*, logprobs, old_logprobs, advantages, response_mask, clip_low, clip_high, dual_clip, agg):
    return aggregate(-0.5 * advantages * logprobs, response_mask, agg), {"half": torch.tensor(0.5)}


def centred(*, token_rewards, response_mask, group_ids, values, reward_baselines, gamma, lam, eps):
    scores = token_rewards.sum(-1, keepdim=True)
    adv = (scores - scores.mean()) * response_mask
    return adv, adv


def length_reward(response_text, ground_truth, extra_info):
    return float(len(response_text))


def wrong_loss(logprobs):
    return logprobs.sum(), {}
'''


def test_file_references_work_wherever_a_registry_name_does(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(USER_FUNCTIONS)
    monkeypatch.chdir(tmp_path)
    cfg = build_config(toy_data(actor={"policy_loss": "mine.py:half_reinforce"},
                                algorithm={"advantage": "mine.py:centred"}, reward={"function": "mine.py:length_reward"}))
    path = tmp_path / "mine.py"
    assert (cfg.actor.policy_loss, cfg.algorithm.advantage, cfg.reward.function) == (
        f"{path}:half_reinforce", f"{path}:centred", f"{path}:length_reward")
    # the references resolve where they run: a loss, an estimator, a reward (a number becomes a RewardResult)
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = losses.policy_loss(cfg.actor.policy_loss, logprobs=logprobs, old_logprobs=logprobs.detach(),
                                     advantages=torch.tensor([[2.0, 2.0]]), response_mask=torch.ones(1, 2))
    assert_close(loss, torch.tensor(1.5))   # -0.5 * 2 * (-1 - 2) / 2
    assert float(stats["half"]) == 0.5
    adv, _ = advantages.compute(cfg.algorithm.advantage, token_rewards=torch.tensor([[0.0, 1.0], [0.0, 3.0]]),
                                response_mask=torch.ones(2, 2))
    assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))
    assert rewards.get(cfg.reward.function)("abc", "", None).score == 3.0


def test_bad_references_name_what_is_wrong(tmp_path):
    (tmp_path / "mine.py").write_text(USER_FUNCTIONS)
    with pytest.raises(ConfigError) as err:
        build_config(toy_data(actor={"policy_loss": f"{tmp_path}/mine.py:wrong_loss"},
                              algorithm={"advantage": f"{tmp_path}/mine.py:nosuch"},
                              reward={"function": f"{tmp_path}/absent.py:score"}))
    text = "\n".join(err.value.problems)
    assert "policy loss" in text and "does not accept old_logprobs" in text
    assert "has no function named 'nosuch'; it defines: centred, half_reinforce, length_reward, wrong_loss" in text
    assert "absent.py' does not exist" in text


def test_registration_checks_the_signature_and_the_name(fresh_registries):
    with pytest.raises(ValueError, match="does not accept old_logprobs"):
        raygraph.register_policy_loss("bad", lambda *, logprobs: logprobs)
    with pytest.raises(ValueError, match="'ppo' is already registered"):
        raygraph.register_policy_loss("ppo", losses.policy_loss_fn("reinforce"))
    with pytest.raises(ValueError, match="without ':'"):
        raygraph.register_policy_loss("a:b", losses.policy_loss_fn("reinforce"))
    with pytest.raises(ValueError, match="needs="):
        raygraph.register_advantage("mine", advantages._ESTIMATORS.get("grpo"), needs=("critic",))
    with pytest.raises(ValueError, match=r"must take \(response_text, ground_truth, extra_info\)"):
        raygraph.register_reward("mine", lambda text: 1.0)

    @raygraph.register_advantage("my_grpo", needs=("group_ids",))
    def my_grpo(**inputs):
        return advantages.compute("grpo", **{k: inputs[k] for k in ("token_rewards", "response_mask", "group_ids")})

    assert advantages.requires("my_grpo") == {"group_ids"} and not advantages.is_builtin("my_grpo")


def test_a_user_estimator_is_checked_against_what_the_workflow_provides(tmp_path, fresh_registries):
    (tmp_path / "est.py").write_text(
        "import raygraph\n"
        "@raygraph.register_advantage('needs_critic', needs=('values',))\n"
        "def needs_critic(**kw):\n    raise NotImplementedError\n")
    plugin = [str(tmp_path / "est.py")]
    with pytest.raises(ConfigError, match="needs values, which workflow 'grpo' does not provide"):
        build_config(toy_data(plugins=plugin, algorithm={"advantage": "needs_critic"}))
    cfg = build_config(toy_data(plugins=plugin, workflow="ppo", algorithm={"advantage": "needs_critic"}))
    assert cfg.uses_critic   # what the estimator declares decides the roles, as for built-ins


# --------------------------------------------------------------------------- the doc's loss = built-in CISPO


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_the_doc_loss_equals_builtin_cispo(tmp_path, fresh_registries, agg):
    import_plugin(str(write_doc_file(tmp_path, "my_cispo.py")))
    gen = torch.Generator().manual_seed(0)
    new = torch.randn(4, 6, generator=gen) - 1
    inputs = {"old_logprobs": new + 0.5 * torch.randn(4, 6, generator=gen), "advantages": torch.randn(4, 6, generator=gen),
              "response_mask": (torch.rand(4, 6, generator=gen) > 0.3).long(), "clip_low": 0.2, "clip_high": 0.28,
              "agg": agg}
    results = {}
    for name in ("cispo", "my_cispo"):
        logprobs = new.clone().requires_grad_()
        loss, stats = losses.policy_loss(name, logprobs=logprobs, **inputs)
        loss.backward()
        results[name] = (loss, logprobs.grad, stats["clipfrac"])
    assert 0 < float(results["cispo"][2]) < 1   # some weights were clipped
    for mine, builtin in zip(results["my_cispo"], results["cispo"]):
        assert_close(mine, builtin)


def test_a_user_loss_gives_the_same_update_as_the_builtin(tmp_path, fresh_registries, tiny_model_path, rollout_batch):
    """Two identical policies, two epochs (so the ratio moves off 1 and clips): the doc's file loss
    and the built-in give the same metrics and the same weights; the file's extra stat is a metric."""
    from raygraph.batch import ADVANTAGES, RESPONSE_MASK
    from raygraph.workers.policy import PolicyWorker

    import_plugin(str(write_doc_file(tmp_path, "my_cispo.py")))
    outcomes = {}
    for name in ("cispo", "my_cispo"):
        worker = PolicyWorker(model_path=tiny_model_path, lr=5e-2, policy_loss=name, ppo_epochs=2, clip_high=0.01,
                              micro_batch_size=4)
        batch = rollout_batch(8, seed=3)
        advantage = torch.randn(batch[RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(1))
        batch = batch.union(worker.logprobs(batch)).with_columns(**{ADVANTAGES: advantage})
        metrics = worker.update(batch)
        outcomes[name] = (metrics, [p.detach().clone() for p in worker.model.parameters()])
    (builtin, w_builtin), (mine, w_mine) = outcomes["cispo"], outcomes["my_cispo"]
    assert builtin["actor/clipfrac"] > 0   # the second epoch clipped some weights
    for key in ("actor/pg_loss", "actor/clipfrac", "actor/grad_norm", "actor/entropy"):
        assert mine[key] == pytest.approx(builtin[key], rel=1e-6, abs=1e-9), key
    assert 0 < mine["actor/is_weight"] <= 1.01 and "actor/is_weight" not in builtin
    for a, b in zip(w_mine, w_builtin):
        assert_close(a, b)


# --------------------------------------------------------------------------- workflow_args


def test_workflow_args_are_checked_recorded_and_passed_to_build(tmp_path):
    from raygraph.graph.nodes import ApplyNode
    from raygraph.run.graphs import build_graphs

    ref = f"{write_doc_file(tmp_path, 'scaled_grpo.py')}:build"
    cfg = load_config(TOY, [f"workflow={ref}"])
    assert cfg.workflow_args == {"advantage_scale": 1.0}   # the default, recorded
    cfg = load_config(TOY, [f"workflow={ref}", "workflow_args.advantage_scale=0.5"])
    assert "workflow_args:\n  advantage_scale: 0.5\n" in to_yaml(cfg)
    out = tmp_path / "resolved.yaml"
    out.write_text(to_yaml(cfg))
    assert load_config(out).workflow_args == {"advantage_scale": 0.5}

    step_graph, _ = build_graphs(cfg, load_workflow(cfg.workflow))
    seen, todo = {}, [step_graph]
    while todo:
        node = todo.pop()
        seen[id(node)] = node
        todo.extend(d for d in node._deps() if id(d) not in seen)
    scales = [n.kwargs["scale"] for n in seen.values() if isinstance(n, ApplyNode) and n.fn.__name__ == "scale_advantages"]
    assert scales == [0.5]

    with pytest.raises(ConfigError) as err:
        load_config(TOY, [f"workflow={ref}", "workflow_args.advantage_scal=0.5", "workflow_args.other=1"])
    assert (f"workflow_args.advantage_scal is not an argument of workflow '{ref}' (did you mean "
            "workflow_args.advantage_scale?); it takes: advantage_scale (from override") in str(err.value)
    with pytest.raises(ConfigError, match="workflow_args.advantage_scale='big': input should be a valid number"):
        load_config(TOY, [f"workflow={ref}", "workflow_args.advantage_scale=big"])
    with pytest.raises(ConfigError, match="workflow 'grpo' takes no arguments.*remove workflow_args.x"):
        load_config(TOY, ["workflow_args.x=1"])


def test_workflow_args_from_an_args_model_or_required_keywords(tmp_path):
    (tmp_path / "with_model.py").write_text(
        "from pydantic import BaseModel, Field\n"
        "class ARGS(BaseModel):\n    min_std: float = Field(0.0, ge=0)\n    rounds: int = 2\n"
        "def build(roles, cfg, *, args):\n    return args\n")
    (tmp_path / "required.py").write_text("def build(roles, cfg, *, k: int):\n    return k\n")
    ref = f"{tmp_path}/with_model.py:build"
    cfg = load_config(TOY, [f"workflow={ref}", "workflow_args.min_std=0.5"])
    assert cfg.workflow_args == {"min_std": 0.5, "rounds": 2}
    args = load_workflow(ref).build_graph(None, cfg)
    assert type(args).__name__ == "ARGS" and (args.min_std, args.rounds) == (0.5, 2)
    with pytest.raises(ConfigError, match="workflow_args.min_std=-1: input should be greater than or equal to 0"):
        load_config(TOY, [f"workflow={ref}", "workflow_args.min_std=-1"])
    with pytest.raises(ConfigError, match=r"workflow_args.rouns is not an argument .* \(did you mean workflow_args.rounds\?\)"):
        load_config(TOY, [f"workflow={ref}", "workflow_args.rouns=3"])
    with pytest.raises(ConfigError, match="workflow_args.k is required by workflow"):
        load_config(TOY, [f"workflow={tmp_path}/required.py:build"])


# --------------------------------------------------------------------------- raygraph validate


@pytest.mark.parametrize(("workflow_file", "overrides", "message"), [
    ("def build(roles, cfg):\n    pass\n", ["workflow={path}:nosuch"], "has no callable 'nosuch'"),
    ("ROLES = ('policy', 'rollout', 'reward', 'teacher')\ndef build(roles, cfg):\n    pass\n", ["workflow={path}"],
     "declares the role(s) 'teacher' in ROLES, which raygraph does not run by itself (its roles: policy, rollout"),
    ("def build(roles, cfg, *, beta: float = 1.0):\n    pass\n", ["workflow={path}", "workflow_args.bta=2"],
     "workflow_args.bta is not an argument"),
])
def test_validate_rejects_a_bad_workflow_with_exit_code_2(tmp_path, capsys, workflow_file, overrides, message):
    from raygraph.cli import EXIT_BAD_CONFIG, main

    path = tmp_path / "wf.py"
    path.write_text(workflow_file)
    assert main(["validate", str(TOY), *(o.format(path=path) for o in overrides)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# --------------------------------------------------------------------------- end to end, under Ray

E2E_PLUGIN = '''
import os
from pathlib import Path

import raygraph
from raygraph.algos import advantages
from raygraph.rewards import get

with open(Path(__file__).with_name("imported_by.txt"), "a") as log:   # which processes import it
    log.write(f"{os.getpid()}\\n")


@raygraph.register_advantage("e2e_grpo", needs=("group_ids",))
def e2e_grpo(*, token_rewards, response_mask, group_ids, eps, **unused):   # GRPO's, doubled
    adv, returns = advantages.compute("grpo", token_rewards=token_rewards, response_mask=response_mask,
                                      group_ids=group_ids, eps=eps)
    return 2 * adv, returns


@raygraph.register_reward("e2e_toy")
def e2e_toy(response_text, ground_truth, extra_info):
    return get("toy_arith")(response_text, ground_truth, extra_info).score + len(response_text) / 8
'''


def test_user_plugins_run_in_every_process_of_a_two_rank_run(tmp_path, monkeypatch, tiny_model_path, ray_local,
                                                             fresh_registries):
    """Files outside the repository register a loss (the doc's), an estimator and a reward; a run
    with 2 policy ranks (FSDP) uses all three: the loss in each policy rank, the estimator on the
    coordinator, the reward in each reward rank."""
    import json

    from raygraph.run.trainer import run

    write_doc_file(tmp_path, "my_cispo.py")
    (tmp_path / "e2e_extra.py").write_text(E2E_PLUGIN)
    monkeypatch.chdir(tmp_path)
    overrides = {
        "plugins": "[my_cispo.py, e2e_extra.py]", "actor.policy_loss": "my_cispo", "algorithm.advantage": "e2e_grpo",
        "reward.function": "e2e_toy", "actor.ppo_epochs": 2, "placement.train_workers": 2,
        "placement.rollout_workers": 2, "data.prompts_per_step": 4, "model.path": tiny_model_path,
        "model.tiny": "null", "data.train_files": "[data/train.parquet]", "data.val_files": "[data/val.parquet]",
        "data.val_prompts": 4, "trainer.output_dir": "runs", "trainer.total_steps": 2, "trainer.dump_rollouts": 1,
        "logging.mlflow": "false", "checkpoint.save_hf": "false",
    }
    cfg = load_config(TOY, [f"{k}={v}" for k, v in overrides.items()])
    summary = run(cfg)
    rows = [json.loads(line) for line in (summary.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:   # the doc loss's own statistic, from both ranks; rewards vary, so it trains
        assert 0.5 < row["actor/is_weight"] <= 1.0 + cfg.actor.clip_high and "actor/clipfrac" in row
        assert row["actor/grad_norm"] > 0 and row["reward/std"] > 0
    dumped = [json.loads(line) for line in (summary.run_dir / "samples" / "train_step_000001.jsonl").open()]
    assert len(dumped) == 16   # each score is the plugin's: toy accuracy (0 or 1) + len(response) / 8
    assert all(min(abs(r["score"] - len(r["response"]) / 8 - acc) for acc in (0, 1)) < 1e-6 for r in dumped)
    groups = sorted({r["uid"] for r in dumped})   # the plugin's estimator: twice GRPO's, from the dumped scores
    scores = torch.tensor([[r["score"]] for r in dumped])
    grpo, _ = advantages.compute("grpo", token_rewards=scores, response_mask=torch.ones_like(scores),
                                 group_ids=[groups.index(r["uid"]) for r in dumped], eps=cfg.algorithm.norm_eps)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in dumped]), 2 * grpo[:, 0], rtol=0, atol=1e-5)
    assert grpo.abs().max() > 0.1
    pids = set((tmp_path / "imported_by.txt").read_text().split())
    assert len(pids) >= 4   # this process (config check, driver), the coordinator, 2 rank actors
    assert f"{tmp_path}/my_cispo.py" in (summary.run_dir / "config.yaml").read_text()
