"""Data checked before training: problems found at `raygraph validate` and at the start of
`train`, not at the step where a bad row is first drawn.

Checked (RL prompts): every row's `data_source` has a rule reward (when rewards are chosen by
data source), every row has a ground truth when a rule reward scores it, the training set holds
at least `data.prompts_per_step` prompts, and the tokenizer's pad id (which fills prompts and
responses) is inside the model's vocabulary. Empty files and unreadable rows are reported by
`raygraph.data` itself when the datasets are read.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from raygraph import rewards
from raygraph.errors import DataInvalid

__all__ = ["DataError", "data_problems", "check_data"]


class DataError(DataInvalid, ValueError):
    """The training or validation data cannot be trained on as configured (every problem listed)."""


def data_problems(cfg, train, val_rows=(), tokenizer=None) -> list[str]:
    """Plain-language problems of the loaded datasets.

    Args:
        cfg: the validated config.
        train: the training dataset (`PromptDataset` for RL; offline datasets are only sized).
        val_rows: the validation `PromptRow`s, if any.
        tokenizer: the policy tokenizer, for the pad-id check (None: skipped).
    """
    problems = []
    if len(train) < cfg.data.prompts_per_step:
        problems.append(f"data.prompts_per_step={cfg.data.prompts_per_step} is larger than the training set "
                        f"({len(train)} usable rows in {', '.join(map(str, cfg.data.train_files))}): lower it, "
                        "or add data")
    rows = list(getattr(train, "rows", ())) + list(val_rows)
    if cfg.reward.kind == "rule" and rows:
        problems.extend(_rule_reward_problems(cfg, rows))
    if tokenizer is not None:
        problems.extend(_pad_problems(cfg, tokenizer))
    return problems


def check_data(cfg, train, val_rows=(), tokenizer=None) -> None:
    """Raise `DataError` listing every problem `data_problems` finds."""
    problems = data_problems(cfg, train, val_rows, tokenizer)
    if problems:
        raise DataError(f"{len(problems)} data problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def _rule_reward_problems(cfg, rows) -> list[str]:
    problems = []
    if cfg.reward.function is None and not cfg.reward.functions:
        known = set(rewards.REWARDS.sources())
        unknown = Counter(r.data_source for r in rows if r.data_source not in known)
        if unknown:
            listed = ", ".join(f"{s!r} ({n} rows)" for s, n in unknown.most_common(5))
            problems.append(f"no rule reward for data_source {listed}; known data sources: "
                            f"{', '.join(sorted(known))}. Name one with reward.function, or register a reward "
                            "for the source")
    missing = [r for r in rows if r.ground_truth is None]
    if missing:
        problems.append(f"{len(missing)} rows have no reward_model.ground_truth (first: prompt {missing[0].index}, "
                        f"{missing[0].prompt_text[-60:]!r}); rule rewards compare the response with it")
    return problems


def _pad_problems(cfg, tokenizer) -> list[str]:
    vocab = _model_vocab_size(cfg.model.path)
    pad = tokenizer.pad_token_id
    if vocab is None or pad is None or 0 <= pad < vocab:
        return []
    return [f"the tokenizer's pad id {pad} is outside the model's vocabulary ({vocab} ids, model.path "
            f"{cfg.model.path}): padding would index past the embedding. Give the tokenizer a pad token that "
            "exists in the model (e.g. its eos token: tokenizer.pad_token = tokenizer.eos_token, saved with "
            "the model), or resize the model's embeddings"]


def _model_vocab_size(path: str) -> int | None:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None  # a hub id: transformers resolves it when the model loads
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)
