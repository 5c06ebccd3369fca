"""Checks of the frozen models a run loads beside the policy: `reference.model_path` and each
`extra_roles.<role>.model_path` (e.g. a distillation teacher).

Their log-probs are compared token by token with the policy's, so they must read the policy's
token ids: the same vocabulary. Checked here from the files, before anything starts, when both
models are local directories; a hub id is checked by the worker when it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["frozen_model_problems", "frozen_models"]


def frozen_models(cfg) -> dict[str, str]:
    """Config key -> model path, for every frozen model other than the policy's start."""
    models = {f"extra_roles.{role}.model_path": extra.model_path for role, extra in cfg.extra_roles.items()}
    if cfg.reference.model_path is not None:
        models["reference.model_path"] = cfg.reference.model_path
    return models


def _looks_local(path: str) -> bool:
    return path.startswith((".", "/", "~")) or Path(path).exists()


def _vocab_size(path: Path) -> int | None:
    config = path / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("vocab_size", data.get("text_config", {}).get("vocab_size"))


def _vocab(path: Path) -> dict | None:
    """The tokenizer's token -> id map, when the directory holds a fast tokenizer file."""
    tokenizer = path / "tokenizer.json"
    return json.loads(tokenizer.read_text()).get("model", {}).get("vocab") if tokenizer.is_file() else None


def frozen_model_problems(cfg) -> list[str]:
    """A frozen model that is missing, or whose vocabulary is not the policy's."""
    problems = []
    policy = Path(cfg.model.tokenizer_path or cfg.model.path)
    policy_size, policy_vocab = _vocab_size(Path(cfg.model.path)), _vocab(policy)
    for key, value in frozen_models(cfg).items():
        path = Path(value).expanduser()
        if not path.is_dir():
            if _looks_local(value):
                problems.append(f"{key}={value!r}: no such model directory")
            continue
        size, vocab = _vocab_size(path), _vocab(path)
        if None not in (size, policy_size) and size != policy_size:
            problems.append(f"{key}={value!r} has a vocabulary of {size} tokens but the policy ({cfg.model.path}) "
                            f"has {policy_size}: its log-probs would be of other tokens; use a model with the "
                            "policy's tokenizer")
        elif None not in (vocab, policy_vocab) and vocab != policy_vocab:
            problems.append(f"{key}={value!r} has a tokenizer other than the policy's ({policy}): the same ids "
                            "would be other tokens; use a model with the policy's tokenizer")
    return problems
