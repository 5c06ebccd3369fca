"""The checks of the `reward` section (`raygraph validate` runs them): what each reward kind needs,
the weighted rule functions, and an LLM judge's template and parser, read here rather than when
the reward actor starts."""

from __future__ import annotations

from raygraph.rewards.judge import CODE_REF, make_parser, make_template
from raygraph.rewards.terms import make_terms

__all__ = ["reward_problems"]


def reward_problems(cfg) -> list[str]:
    """One line per problem of the `reward` section."""
    reward = cfg.reward
    if reward.kind == "model" and not reward.model_path:
        return ["reward.kind='model' needs reward.model_path (the reward model to load)"]
    if reward.kind == "remote" and reward.remote is None:
        return ["reward.kind='remote' needs reward.remote.url (the scoring service)"]
    if (reward.kind == "judge") != (reward.judge is not None):
        return ["reward.kind='judge' needs reward.judge.model_path (the judge model)" if reward.kind == "judge"
                else f"reward.judge applies to reward.kind=judge only (reward.kind={reward.kind!r})"]
    if reward.kind == "judge":
        return _judge(reward) + _reward_terms(reward)
    return _reward_terms(reward)


def _judge(reward) -> list[str]:
    """The judge's template and pattern parser, read now rather than when its actor starts."""
    problems = []
    if reward.function is not None:
        problems.append("reward.kind='judge': add rule rewards to the judge's verdict with reward.functions "
                        "(weighted terms), not reward.function")
    try:
        make_template(reward.judge.template, reward.judge.template_format)
        if not CODE_REF.fullmatch(reward.judge.parser):   # user code is imported where it runs
            make_parser(reward.judge.parser)
    except ValueError as exc:
        problems.append(str(exc))
    if any(t.name == "judge" for t in reward.functions):
        problems.append("reward.functions: the name 'judge' is the judge's own metric (reward/judge/mean); "
                        "name the function otherwise")
    return problems


def _reward_terms(reward) -> list[str]:
    problems = []
    if reward.kind not in ("rule", "judge"):   # a judge's score may add weighted rule functions
        set_keys = [k for k, v in (("functions", reward.functions), ("workers", reward.workers),
                                   ("timeout_s", reward.timeout_s)) if v]
        problems += [f"reward.{k} applies to rule rewards only (reward.kind={reward.kind!r})" for k in set_keys]
    if reward.functions and reward.function is not None:
        problems.append("set reward.function or reward.functions, not both")
    if reward.timeout_s is not None and reward.workers == 0:
        problems.append("reward.timeout_s needs reward.workers >= 1: a call in the reward actor itself cannot "
                        "be interrupted")
    names = [t.name for t in make_terms(None, [t.model_dump() for t in reward.functions])]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice and reward.functions:
        problems.append(f"reward.functions: the metric names {twice} are used twice; give each a distinct name")
    return problems
