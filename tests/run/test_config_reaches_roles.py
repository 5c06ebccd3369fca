"""Every config key that acts through a role reaches that role, and only where it should.

A table: one row per key the role builders read (`raygraph/run/role_specs.py`). Each row changes
the key from a base config and names every (role, argument) that must change and to what; the
test compares the role specs (worker class, ranks, pool and constructor arguments, nested ones
flattened) before and after and asserts the difference is exactly the row's. A key that stopped
reaching its worker, or that reached another argument, fails its row. Every argument also binds
to its worker's constructor, so a name the worker does not take fails here rather than at the
first run. The table covers every config key named in the builders (a last test checks that).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from raygraph.config import load_config
from raygraph.run.role_specs import role_specs

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs/grpo_toy.yaml")
MULTITURN = str(ROOT / "configs/demo_multiturn.yaml")
PPO = ("policy", "rollout", "reward", "critic")
# Base configs: a PPO run with a reference (hf rollout, rule reward), the same with vLLM, with
# remote and model rewards, and the multi-turn demo (an agent rollout, on either engine).
DEMO_PROGRAM = "raygraph.agents.demo_program:run"
BASES = {
    "hf": (TOY, ["actor.kl_loss_coef=0.1", "workflow=ppo", "algorithm.advantage=gae"]),
    "vllm": (TOY, ["rollout.engine=vllm"]),
    "remote": (TOY, ["reward.kind=remote", "reward.remote.url=http://127.0.0.1:9/score"]),
    "model": (TOY, ["reward.kind=model", "reward.model_path=runs/models/rm"]),
    "judge": (TOY, ["reward.kind=judge", "reward.judge.model_path=runs/models/judge"]),
    "agent": (MULTITURN, []),
    "agent_vllm": (MULTITURN, ["rollout.engine=vllm"]),
    "program": (MULTITURN, ["rollout.agent.env=null", f"rollout.agent.program={DEMO_PROGRAM}"]),
    "disagg": (TOY, ["placement.mode=disaggregated", "placement.train_workers=2", "placement.rollout_workers=1",
                     "data.prompts_per_step=4", "actor.kl_loss_coef=0.1", "workflow=ppo", "algorithm.advantage=gae"]),
}
STEPS = 2   # grpo_toy's total_steps: the optimizer counts steps, one per batch with default batches


def _optimizer_rows(section: str, role: str) -> list:
    """Rows of the keys `_optim_args` reads, which the policy (`actor.*`) and the critic
    (`critic.*`) share; the schedule's length counts optimizer steps (epochs x mini-batches)."""
    settings = [("optim.lr=0.5", "lr", 0.5), ("optim.weight_decay=0.3", "weight_decay", 0.3),
                ("optim.betas=[0.5,0.6]", "betas", (0.5, 0.6)), ("optim.warmup_steps=7", "warmup_steps", 7),
                ("optim.schedule=cosine", "lr_schedule", "cosine"), ("optim.min_lr_ratio=0.25", "min_lr_ratio", 0.25),
                ("grad_clip=0.5", "grad_clip", 0.5)]
    return [("hf", [f"{section}.{setting}"], {(role, arg): value}) for setting, arg, value in settings] + [
        ("hf", [f"{section}.ppo_epochs=3"], {(role, "ppo_epochs"): 3, (role, "total_steps"): 3 * STEPS}),
        ("hf", [f"{section}.mini_batch_size=4"], {(role, "mini_batch_size"): 4, (role, "total_steps"): 4 * STEPS})]


# (base, overrides, {(role, argument): expected value}); the role's "world_size" / "pool" /
# "distributed" / "cls" count as arguments, a nested argument is "outer.inner".
ROWS = [
    ("hf", ["model.tiny=null", "model.path=runs/models/other"],
     {**{(r, "model_path"): "runs/models/other" for r in ("policy", "rollout", "reference", "critic")},
      ("reward", "tokenizer_path"): "runs/models/other"}),
    ("hf", ["model.dtype=bfloat16"], {(r, "dtype"): "bfloat16" for r in ("policy", "rollout", "reference", "critic")}),
    ("hf", ["model.attn_impl=eager"], {(r, "attn_impl"): "eager"
                                       for r in ("policy", "rollout", "reference", "critic")}),
    ("hf", ["model.tokenizer_path=runs/tok"], {("reward", "tokenizer_path"): "runs/tok"}),
    ("hf", ["model.gradient_checkpointing=true"], {("policy", "gradient_checkpointing"): True}),
    *_optimizer_rows("actor", "policy"),
    ("hf", ["actor.micro_batch_size=3"], {(r, "micro_batch_size"): 3 for r in ("policy", "reference")}),
    ("hf", ["actor.max_tokens_per_micro_batch=500"], {(r, "max_tokens_per_micro_batch"): 500
                                                      for r in ("policy", "reference")}),
    ("hf", ["actor.policy_loss=gspo"], {("policy", "policy_loss"): "gspo"}),
    ("hf", ["actor.clip_low=0.1"], {("policy", "clip_low"): 0.1}),
    ("hf", ["actor.clip_high=0.4"], {("policy", "clip_high"): 0.4}),
    ("hf", ["actor.dual_clip=4.0"], {("policy", "dual_clip"): 4.0}),
    ("hf", ["actor.loss_agg=seq-mean-token-sum"], {("policy", "loss_agg"): "seq-mean-token-sum"}),
    ("hf", ["actor.entropy_coef=0.01"], {("policy", "entropy_coef"): 0.01}),
    ("hf", ["actor.kl_loss_coef=0.2"], {("policy", "kl_loss_coef"): 0.2}),
    ("hf", ["actor.kl_loss_kind=k1"], {("policy", "kl_loss_kind"): "k1"}),
    ("hf", ["critic.model_path=runs/models/value"], {("critic", "model_path"): "runs/models/value"}),
    *_optimizer_rows("critic", "critic"),
    ("hf", ["critic.micro_batch_size=3"], {("critic", "micro_batch_size"): 3}),
    ("hf", ["critic.max_tokens_per_micro_batch=500"], {("critic", "max_tokens_per_micro_batch"): 500}),
    ("hf", ["critic.value_clip=0.7"], {("critic", "value_clip"): 0.7}),
    ("hf", ["critic.loss_agg=seq-mean-token-sum"], {("critic", "loss_agg"): "seq-mean-token-sum"}),
    ("hf", ["trainer.total_steps=5"], {("policy", "total_steps"): 5, ("critic", "total_steps"): 5}),
    ("hf", ["trainer.seed=9"], {(r, "seed"): 9 for r in ("policy", "rollout", "critic")}),
    ("hf", ["reference.model_path=runs/models/ref"], {("reference", "model_path"): "runs/models/ref"}),
    ("hf", ["reference.shard=true"], {("reference", "shard"): True, ("reference", "distributed"): True}),
    ("hf", ["rollout.n=3"], {("rollout", "n"): 3}),
    ("hf", ["rollout.max_new_tokens=5"], {("rollout", "max_new_tokens"): 5}),
    ("hf", ["rollout.temperature=0.5"], {(r, "temperature"): 0.5 for r in ("policy", "rollout", "reference")}),
    ("hf", ["rollout.top_p=0.5"], {("rollout", "top_p"): 0.5}),
    ("hf", ["rollout.top_k=5"], {("rollout", "top_k"): 5}),
    ("hf", ["rollout.stop_token_ids=[3,4]"], {("rollout", "stop_token_ids"): (3, 4)}),
    ("hf", ["rollout.micro_batch_size=5"], {("rollout", "micro_batch_size"): 5}),
    ("hf", ["rollout.partial_rollouts=false"], {("rollout", "partial_rollouts"): False}),
    ("hf", ["reward.function=word_problems"], {("reward", "function"): "word_problems"}),
    ("hf", ["reward.on_non_finite=zero"], {("reward", "on_non_finite"): "zero"}),
    ("hf", ["reward.workers=3"], {("reward", "workers"): 3}),
    ("hf", ["reward.workers=1", "reward.timeout_s=7.5"], {("reward", "workers"): 1, ("reward", "timeout_s"): 7.5}),
    ("hf", ["reward.on_error=zero"], {("reward", "on_error"): "zero"}),
    ("hf", ["plugins=[examples/dapo_filter.py]"], {("reward", "plugins"): (str(ROOT / "examples/dapo_filter.py"),)}),
    ("vllm", ["rollout.gpu_memory_utilization=0.2"], {("rollout", "gpu_memory_utilization"): 0.2}),
    ("vllm", ["rollout.max_model_len=100"], {("rollout", "max_model_len"): 100}),
    ("vllm", ["data.max_prompt_length=70"], {("rollout", "max_model_len"): 70 + 8}),
    ("vllm", ["rollout.enforce_eager=false"], {("rollout", "enforce_eager"): False}),
    ("vllm", ["rollout.enable_prefix_caching=true"], {("rollout", "enable_prefix_caching"): True}),
    ("vllm", ["rollout.vllm_engine_core=own_process"], {("rollout", "engine_core"): "own_process"}),
    ("judge", ["reward.judge.model_path=runs/models/other"], {("reward", "model_path"): "runs/models/other"}),
    ("judge", ["reward.judge.template='Rate {response}'"], {("reward", "template"): "Rate {response}"}),
    ("judge", ["reward.judge.template_format=jinja", "reward.judge.template='Rate {{ response }}'"],
     {("reward", "template_format"): "jinja", ("reward", "template"): "Rate {{ response }}"}),
    ("judge", ["reward.judge.chat=false"], {("reward", "chat"): False}),
    ("judge", ["reward.judge.parser='Score: (\\d+)'"], {("reward", "parser"): "Score: (\\d+)"}),
    ("judge", ["reward.judge.weight=0.25"], {("reward", "weight"): 0.25}),
    ("judge", ["reward.judge.engine=vllm"], {("reward", "engine"): "vllm"}),
    ("judge", ["reward.judge.max_new_tokens=5"], {("reward", "max_new_tokens"): 5}),
    ("judge", ["reward.judge.max_model_len=300"], {("reward", "max_model_len"): 300}),
    ("judge", ["reward.judge.gpu_memory_utilization=0.05"], {("reward", "gpu_memory_utilization"): 0.05}),
    ("judge", ["reward.on_error=zero", "reward.functions=[{function: toy_arith, weight: 2.0}]"],
     {("reward", "on_error"): "zero", ("reward", "functions"): [{"function": "toy_arith", "weight": 2.0, "name": None}]}),
    ("remote", ["reward.remote.timeout_s=4.5"], {("reward", "timeout_s"): 4.5}),
    ("remote", ["reward.remote.max_retries=5"], {("reward", "max_retries"): 5}),
    ("remote", ["reward.remote.backoff_s=0.25"], {("reward", "backoff_s"): 0.25}),
    ("remote", ["reward.remote.auth_env=RM_TOKEN"], {("reward", "auth_env"): "RM_TOKEN"}),
    ("remote", ["reward.remote.url=http://127.0.0.1:8/other"], {("reward", "url"): "http://127.0.0.1:8/other"}),
    ("remote", ["reward.on_non_finite=zero"], {("reward", "on_non_finite"): "zero"}),
    ("model", ["reward.model_path=runs/models/rm2"], {("reward", "model_path"): "runs/models/rm2"}),
    ("model", ["reward.on_non_finite=zero"], {("reward", "on_non_finite"): "zero"}),
    # the demo: 32 prompt tokens, 2 turns of 3 tokens, messages of 256 tokens; an episode's token
    # budget by default = prompt + turns x turn tokens + (turns - 1) x (message tokens + 16)
    ("agent", ["rollout.agent.max_turns=3"], {("rollout", "agent.budgets.max_turns"): 3,
                                              ("rollout", "agent.budgets.max_total_tokens"): 32 + 9 + 2 * 272}),
    ("agent", ["rollout.agent.max_new_tokens=2"], {("rollout", "agent.budgets.max_new_tokens"): 2,
                                                   ("rollout", "agent.budgets.max_total_tokens"): 32 + 4 + 272}),
    ("agent", ["rollout.agent.max_total_tokens=50"], {("rollout", "agent.budgets.max_total_tokens"): 50}),
    ("agent", ["rollout.agent.max_message_tokens=9"], {("rollout", "agent.budgets.max_message_tokens"): 9,
                                                       ("rollout", "agent.budgets.max_total_tokens"): 32 + 6 + 25}),
    ("agent", ["rollout.agent.env=reveal_then_answer"], {("rollout", "agent.env"): "reveal_then_answer"}),
    ("agent_vllm", ["rollout.agent.dispatch=least_loaded"], {("rollout", "agent.groups_in_flight"): 2}),
    ("agent_vllm", ["rollout.agent.dispatch=least_loaded", "rollout.agent.groups_in_flight=3"],
     {("rollout", "agent.groups_in_flight"): 3}),
    ("agent", ["rollout.agent.groups_in_flight=3"], {}),   # the even split has no use for it
    ("agent", ["rollout.agent.env_args={retry_reward: 0.25}"], {("rollout", "agent.env_args.retry_reward"): 0.25}),
    ("agent", ["rollout.agent.tools=[calculator]"], {("rollout", "agent.tools"): ["calculator"]}),
    ("agent", ["rollout.agent.tool_parser=json"], {("rollout", "agent.tool_parser"): "json"}),
    ("agent", ["rollout.agent.tool_timeout_s=2.5"], {("rollout", "agent.tool_timeout_s"): 2.5}),
    ("agent", ["rollout.agent.env_timeout_s=2.5"], {("rollout", "agent.env_timeout_s"): 2.5}),
    ("agent", ["rollout.agent.env_workers=3"], {("rollout", "agent.env_workers"): 3}),
    ("agent", ["rollout.agent.tool_role=user"], {("rollout", "agent.tool_role"): "user"}),
    ("agent", ["rollout.agent.env_hosts=2"], {("rollout", "agent.env_hosts"): 2}),
    ("agent", ["rollout.agent.env_host_cpus=0.5"], {("rollout", "agent.env_host_cpus"): 0.5}),
    ("agent", ["rollout.agent.env=null", f"rollout.agent.program={DEMO_PROGRAM}"],
     {("rollout", "agent.env"): None, ("rollout", "agent.program"): DEMO_PROGRAM,
      ("rollout", "agent.temperature"): 1.0, ("rollout", "agent.top_p"): 1.0}),
    ("program", ["rollout.agent.program_args={retry_reward: 0.25}"],
     {("rollout", "agent.program_args.retry_reward"): 0.25}),
    ("program", ["rollout.agent.program_timeout_s=5"], {("rollout", "agent.program_timeout_s"): 5.0}),
    ("program", ["rollout.agent.program_host=127.0.0.1"], {("rollout", "agent.host"): "127.0.0.1"}),
    ("program", ["rollout.temperature=0.5"], {("rollout", "temperature"): 0.5, ("rollout", "agent.temperature"): 0.5,
                                              ("policy", "temperature"): 0.5}),
    ("agent", ["data.chat_template_kwargs={enable_thinking: false}"],
     {("rollout", "agent.chat_template_kwargs.enable_thinking"): False}),
    ("disagg", ["placement.rollout_workers=2", "data.prompts_per_step=8"],
     {(r, "world_size"): 2 for r in ("rollout", "reward")}),
    ("disagg", ["placement.train_workers=1"],
     {(r, "world_size"): 1 for r in ("policy", "reference", "critic")}),
    # 16 samples a step (4 prompts x 4), mini-batches of 8: 2 optimizer steps a batch, 4 samples per rank of 2
    ("disagg", ["actor.mini_batch_size=8"], {("policy", "mini_batch_size"): 4, ("policy", "total_steps"): 2 * STEPS}),
]


def _config(base: str, overrides: list[str], tmp_path):
    path, base_overrides = BASES[base]
    return load_config(path, [f"trainer.output_dir={tmp_path}", *base_overrides, *overrides])


def _flat(value, prefix: str, out: dict) -> dict:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flat(inner, f"{prefix}.{key}" if prefix else key, out)
    else:
        out[prefix] = value
    return out


def _view(cfg) -> dict:
    """(role, argument) -> value over every role spec, nested dicts flattened."""
    view = {}
    for role, spec in role_specs(cfg, PPO).items():
        fields = {"cls": spec.factory.__name__, "world_size": spec.world_size, "pool": spec.pool,
                  "distributed": spec.distributed, **_flat(spec.kwargs, "", {})}
        view.update({(role, name): value for name, value in fields.items()})
    return view


@pytest.mark.parametrize("base, overrides, expected", ROWS, ids=[" ".join(r[1]) for r in ROWS])
def test_a_config_key_changes_exactly_the_role_arguments_it_names(base, overrides, expected, tmp_path):
    before = _view(_config(base, [], tmp_path))
    after = _view(_config(base, overrides, tmp_path))
    changed = {k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    assert changed == expected


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_role_argument_binds_to_its_worker_constructor(base, tmp_path):
    for spec in role_specs(_config(base, [], tmp_path), PPO).values():
        if spec.factory.__init__ is object.__init__:
            assert not spec.kwargs, f"{spec.factory.__name__} takes no arguments"
            continue
        params = inspect.signature(spec.factory.__init__).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"{spec.factory.__name__} takes **kwargs"
        inspect.signature(spec.factory.__init__).bind(None, **spec.kwargs)   # raises on a name it does not take


def test_the_table_covers_every_config_key_the_role_builders_read():
    source = (ROOT / "raygraph/run/role_specs.py").read_text()
    sections = {"cfg.model": "model", "cfg.rollout": "rollout", "r": "rollout", "a": "rollout.agent",
                "actor": "actor", "critic": "critic", "ref": "reference", "reward": "reward",
                "remote": "reward.remote", "judge": "reward.judge", "optim": "actor.optim", "cfg.trainer": "trainer", "cfg.data": "data",
                "lora": "model.lora", "p": "placement", "extra": "extra_roles"}
    read = set()
    for obj, section in sections.items():
        for name in re.findall(rf"(?<![\w.]){re.escape(obj)}\.(\w+)\b", source):
            read.add(f"{section}.{name}")
    covered = {o.split("=")[0] for _, overrides, _ in ROWS for o in overrides}
    elsewhere = {
        # a choice of worker class or of placement, covered by tests/run/test_role_kinds.py
        "rollout.engine", "reward.kind", "rollout.agent", "model.lora", "placement.mode", "placement.pools",
        "placement.roles", "placement.cpus_per_worker", "placement.gpus_per_worker", "placement.strategy",
        "extra_roles.workers",
        # extra roles and LoRA have their own wiring tests (tests/test_distill.py, tests/test_lora_config.py)
        "extra_roles.model_path", "extra_roles.dtype", "extra_roles.micro_batch_size", "extra_roles.shard",
        "model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules",
        # need GPUs (a config error on CPU): tests/gpu
        "rollout.tensor_parallel_size", "rollout.sleep_between_steps",
        "actor.optim", "critic.optim", "reward.remote", "reward.functions", "reward.judge",   # sections; their keys have rows
    }
    missing = sorted(k for k in read - covered - elsewhere if not k.endswith(("total_tokens", "turn_tokens")))
    assert not missing, f"config keys the role builders read with no row in ROWS: {missing}"
