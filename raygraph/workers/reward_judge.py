"""An LLM judge as the reward (`reward.kind=judge`): a frozen causal LM reads each answer in a
prompt made from a template and its verdict is parsed into the score.

The judge generates greedily with one of the rollout engines (`raygraph.workers.engines`: the HF
sampler or a vLLM engine in this actor), all the batch's verdicts in one call. The answer judged
is a row's last run of model tokens (an agent episode's final turn), decoded with the policy's
tokenizer. Score = weight x verdict + the weighted rule functions of `reward.functions`, if any
(scored by a `RuleRewardWorker` beside it). A verdict the parser reads no number from, or a judge
prompt too long for the engine, is a failed call: `on_error="fail"` stops the step naming the
sample and the judge's output; "zero" scores the judge's term 0 and counts it in
`reward_extra.judge_unparsed` (metric `reward/judge_unparsed`: share of rows). The judge's
prompts and outputs go to the sample dumps (`judge_prompt`, `judge_output`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raygraph.batch import (
    GROUND_TRUTH,
    JUDGE_OUTPUT,
    JUDGE_PROMPT,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_MESSAGES,
    PROMPT_TEXT,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    RESPONSES,
    REWARD_EXTRA_PREFIX,
    TOKEN_LEVEL_SCORES,
    UID,
    Batch,
)
from raygraph.errors import RewardFailed
from raygraph.models.loading import load_tokenizer
from raygraph.rewards import judge
from raygraph.rewards.batching import reward_batch
from raygraph.workers.engines import ROLLOUT_ENGINES
from raygraph.workers.reward_rule import RuleRewardWorker

__all__ = ["JudgeRewardWorker", "JudgeFailed"]

log = logging.getLogger("raygraph")

UNPARSED = "judge_unparsed"


class JudgeFailed(RewardFailed, ValueError):
    """The judge's verdict on a sample could not be read as a number (under `on_error=fail`)."""


class JudgeRewardWorker:
    """Scores rollouts with an LLM judge (module docstring).

    Args:
        model_path: the judge (causal LM directory or hub id).
        tokenizer_path: the policy's tokenizer (to decode the answers and prompts).
        template, template_format, chat, parser, weight: see `raygraph.config.JudgeConfig`.
        engine: "hf" | "vllm"; max_new_tokens, max_model_len, gpu_memory_utilization: the verdict's and
            the engine's budgets.
        dtype: the judge's weights.
        functions: weighted rule functions added to the judge's term (`RuleRewardWorker`).
        on_error, on_non_finite: see `raygraph.config.RewardConfig`.
        workers, timeout_s, plugins: the rule functions' pool (`RuleRewardWorker`).
    """

    def __init__(self, *, model_path: str, tokenizer_path: str, template: str = judge.DEFAULT_TEMPLATE,
                 template_format: str = "python", chat: bool = True, parser: str = judge.DEFAULT_PARSER,
                 weight: float = 1.0, engine: str = "hf", max_new_tokens: int = 16, max_model_len: int = 2048,
                 gpu_memory_utilization: float | None = None,
                 dtype: str = "float32", functions: Sequence[Mapping[str, Any]] = (), on_error: str = "fail",
                 on_non_finite: str = "fail", workers: int = 0, timeout_s: float | None = None,
                 plugins: Sequence[str] = ()) -> None:
        self.render = judge.make_template(template, template_format)
        self.parse = judge.make_parser(parser)
        self.model_path, self.weight, self.chat = model_path, weight, chat
        self.on_error, self.on_non_finite = on_error, on_non_finite
        self.tokenizer = load_tokenizer(tokenizer_path)
        if engine not in ROLLOUT_ENGINES:
            raise ValueError(f"unknown judge engine {engine!r}; valid: {', '.join(ROLLOUT_ENGINES)}")
        budget = ({"max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization}
                  if engine == "vllm" else {})
        self.engine = ROLLOUT_ENGINES[engine](model_path=model_path, dtype=dtype, max_new_tokens=max_new_tokens,
                                              **budget)
        self.max_prompt_tokens = max_model_len - max_new_tokens if engine == "vllm" else None
        self.rules = RuleRewardWorker(tokenizer_path, functions=functions, on_error=on_error,
                                      on_non_finite=on_non_finite, workers=workers, timeout_s=timeout_s,
                                      plugins=plugins) if functions else None

    def close(self) -> None:
        for part in (self.engine, self.rules):
            if part is not None and hasattr(part, "close"):
                part.close()

    # ------------------------------------------------------------------------------- scoring
    def score(self, batch: Batch) -> Batch:
        """`token_level_scores` (weight x verdict + rule terms, on each row's last response token),
        `reward_extra.judge/mean` (the verdict, 0 when unread; metric reward/judge/mean),
        `reward_extra.judge_unparsed`, the rule functions' extras, and the text columns
        `judge_prompt`, `judge_output`."""
        n, uids = len(batch), list(batch[UID]) if UID in batch else None
        prompts = self._judge_prompts(batch)
        rows = [i for i in range(n) if prompts[i] is not None]
        outputs = self._verdicts([prompts[i] for i in rows])
        verdicts, unparsed, texts, failures = [0.0] * n, [0.0] * n, [""] * n, []
        for i, text in zip(rows, outputs):
            texts[i] = text if text is not None else ""
            value = None if text is None else self.parse(text)
            if value is None:
                failures.append(self._failure(i, uids, prompts[i], text))
                unparsed[i] = 1.0
            else:
                verdicts[i] = value
        if failures:
            self._on_failures(failures, n)
        scores = [self.weight * v for v in verdicts]
        extras: dict[str, list[float]] = {"judge/mean": verdicts, UNPARSED: unparsed}
        if self.rules is not None:
            ruled = self.rules.score(batch)
            scores = [s + r for s, r in zip(scores, ruled[TOKEN_LEVEL_SCORES].sum(-1).tolist())]
            theirs = {name[len(REWARD_EXTRA_PREFIX):]: ruled[name].tolist()
                      for name in ruled.tensors if name.startswith(REWARD_EXTRA_PREFIX)}
            clash = sorted(set(theirs) & set(extras))
            if clash:
                raise ValueError(f"reward.functions report {clash}, which are the judge's own columns; "
                                 "rename the function (its `name`) or its extras")
            extras.update(theirs)
        out = reward_batch(scores, extras, batch[RESPONSE_MASK], source=f"the judge {self.model_path}", uids=uids,
                           on_non_finite=self.on_non_finite)
        return out.with_columns(**{JUDGE_PROMPT: [p or "" for p in prompts], JUDGE_OUTPUT: texts})

    def _judge_prompts(self, batch: Batch) -> list[str | None]:
        """The judge's prompt text of each row (None: an empty answer, e.g. only an end-of-turn token,
        is not judged and its term scores 0)."""
        n = len(batch)
        responses, mask = batch[RESPONSES], batch[RESPONSE_MASK]
        answers = self.tokenizer.batch_decode([judge.final_answer_ids(responses[i], mask[i]) for i in range(n)],
                                              skip_special_tokens=True)
        prompt_texts = (list(batch[PROMPT_TEXT]) if PROMPT_TEXT in batch else self.tokenizer.batch_decode(
            [ids[m.bool()].tolist() for ids, m in zip(batch[PROMPT_IDS], batch[PROMPT_MASK])],
            skip_special_tokens=False))
        messages = list(batch[PROMPT_MESSAGES]) if PROMPT_MESSAGES in batch else [None] * n
        truths = list(batch[GROUND_TRUTH]) if GROUND_TRUTH in batch else [None] * n
        return [None if not answers[i].strip() else self.render({
            "question": judge.question_of(messages[i], prompt_texts[i]), "prompt": prompt_texts[i],
            "response": answers[i], "ground_truth": "" if truths[i] is None else str(truths[i])})
            for i in range(n)]

    def _verdicts(self, texts: list[str]) -> list[str | None]:
        """The judge's greedy output for each prompt text (None: the prompt does not fit)."""
        tok = self.engine.tokenizer
        if self.chat and tok.chat_template:
            ids = [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)) for t in texts]
        else:
            ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
        fits = [k for k, x in enumerate(ids) if self.max_prompt_tokens is None or len(x) <= self.max_prompt_tokens]
        out: list[str | None] = [None] * len(texts)
        if not fits:
            return out
        width = max(len(ids[k]) for k in fits)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        prompt_ids = torch.tensor([[pad] * (width - len(ids[k])) + ids[k] for k in fits])
        prompt_mask = torch.tensor([[0] * (width - len(ids[k])) + [1] * len(ids[k]) for k in fits])
        rows = self.engine.generate(Batch({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask}), greedy=True)
        for k, text in zip(fits, rows[RESPONSE_TEXT]):
            out[k] = str(text)
        return out

    def _failure(self, row: int, uids: list | None, prompt: str | None, text: str | None) -> str:
        where = f"row {row}" + (f" (uid {uids[row]!r})" if uids is not None else "")
        why = (f"its prompt ({len(prompt or '')} characters) does not fit the judge's max_model_len"
               if text is None else f"no number in its output {text!r}")
        return f"{where}: {why}"

    def _on_failures(self, failures: list[str], rows: int) -> None:
        if self.on_error == "fail":
            raise JudgeFailed(f"the judge {self.model_path} gave no score for {failures[0]}"
                              + (f" (and {len(failures) - 1} more rows)" if len(failures) > 1 else "")
                              + "; fix reward.judge.parser or template, or set reward.on_error=zero to score "
                              "such samples 0 (counted in reward/judge_unparsed)")
        log.warning("the judge gave no score for %d of %d rows, scored 0 (first: %s)", len(failures), rows,
                    failures[0])
