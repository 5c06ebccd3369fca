"""What a step's graph reports for people: metrics of the batch (reward, lengths, advantages,
weight versions), validation accuracy and pass@k / maj@n, and the sample rows as text records.
Whole-batch functions a workflow places with `roles.apply(fn, batch)`; pure, no Ray."""

from __future__ import annotations

import collections
import math

import numpy as np
import torch

from raygraph.agents.episode import TRUNCATIONS
from raygraph.batch import (
    ADVANTAGES,
    AGENT_CONVERSATION,
    AGENT_ELSEWHERE,
    AGENT_ENV_S,
    AGENT_TOOL_ERROR,
    AGENT_TOOL_OK,
    AGENT_TOOL_TIMEOUT,
    AGENT_TRUNCATION,
    AGENT_TURNS,
    DATA_SOURCE,
    GROUND_TRUTH,
    JUDGE_OUTPUT,
    JUDGE_PROMPT,
    PROMPT_TEXT,
    RESPONSE_LENGTH,
    RESPONSE_MASK,
    RESPONSE_TEXT,
    REWARD_EXTRA_PREFIX,
    STALENESS,
    TOKEN_LEVEL_SCORES,
    TOKEN_WEIGHT_VERSION,
    UID,
    WEIGHT_VERSION,
    Batch,
)
from raygraph.graph.whole_batch import sequence_scores

__all__ = ["rollout_metrics", "streaming_metrics", "validation_metrics", "sampled_validation_metrics", "pass_at_k", "sample_records",
           "DUMP_ROWS", "VAL_CONSOLE_ROWS"]

# The driver asks for a step's samples as text with `meta[DUMP_ROWS]` (rows wanted, -1 = all) in
# the step's prompts batch; they come back in the step's report (`raygraph.graph.report`).
DUMP_ROWS = "dump_rows"
VAL_CONSOLE_ROWS = 3   # validation always returns a few samples, for the console


def _reward_summary(batch: Batch, prefix: str) -> dict[str, float]:
    scores = sequence_scores(batch)
    out = {f"{prefix}/mean": float(scores.mean()), f"{prefix}/std": float(scores.std(unbiased=False))}
    for name, column in batch.tensors.items():
        if name.startswith(REWARD_EXTRA_PREFIX):
            out[f"{prefix}/{name[len(REWARD_EXTRA_PREFIX):]}"] = float(column.float().mean())
    return out


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """Per-step numbers about the batch: reward, lengths, advantage range, weight versions.

    (`rollout/logprob_diff_max`, the rollout engine's log-probs against the policy's, comes from
    `PolicyWorker.update`, which computes the policy's anyway.)"""
    if len(batch) == 0:   # every group filtered out (DAPO dynamic sampling): nothing to describe
        return {"rollout/samples": 0.0, "rollout/tokens": 0.0}
    mask = batch[RESPONSE_MASK]
    lengths = batch[RESPONSE_LENGTH].float() if RESPONSE_LENGTH in batch else mask.sum(-1).float()
    out = _reward_summary(batch, "reward")
    out.update({
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/clip_ratio": _clip_ratio(batch, lengths, mask.shape[1]),
        "rollout/tokens": float(mask.sum()),
        "rollout/samples": float(len(batch)),
    })
    if ADVANTAGES in batch:
        valid = batch[ADVANTAGES][mask.bool()]
        out["actor/advantage_mean"] = float(valid.mean()) if valid.numel() else 0.0
        out["actor/advantage_abs_max"] = float(valid.abs().max()) if valid.numel() else 0.0
    if WEIGHT_VERSION in batch:
        out["weights/rollout_version_min"] = float(batch[WEIGHT_VERSION].min())
    if "kl_in_reward" in batch.meta:   # set by compute_advantages, with the coefficient it used
        out["actor/kl_in_reward"] = float(batch.meta["kl_in_reward"])
        out["actor/kl_coef"] = float(batch.meta["kl_coef"])
    if AGENT_TURNS in batch:
        out.update(agent_metrics(batch))
    if TOKEN_WEIGHT_VERSION in batch:
        out.update(streaming_metrics(batch))
    return out


def streaming_metrics(batch: Batch) -> dict[str, float]:
    """Streamed rollouts (`raygraph.workers.streaming`): how many versions each trained token, and
    each group's oldest token, lags the weights being updated (`stream/token_staleness_<j>`,
    `stream/group_staleness_<j>`: shares, j = 0 .. the largest), and the share of samples whose
    tokens come from more than one weight version (`stream/mixed_version_samples`)."""
    mask = batch[RESPONSE_MASK].bool()
    current = batch[WEIGHT_VERSION] + batch[STALENESS]   # (B,) the weights held when the rows were taken
    token_lag = (current[:, None] - batch[TOKEN_WEIGHT_VERSION])[mask]
    groups: dict[str, int] = {}
    for uid, lag in zip(batch[UID], batch[STALENESS].tolist()):   # a row's staleness: its oldest token's
        groups[uid] = max(groups.get(uid, 0), lag)
    group_lag = torch.tensor(list(groups.values()))
    versions = batch[TOKEN_WEIGHT_VERSION].masked_fill(~mask, -1)
    first = versions.gather(1, torch.zeros_like(versions[:, :1]))
    mixed = ((versions != first) & mask).any(-1)
    out = {"stream/token_staleness_mean": float(token_lag.float().mean()) if token_lag.numel() else 0.0,
           "stream/mixed_version_samples": float(mixed.float().mean())}
    for j in range(int(max(token_lag.max() if token_lag.numel() else 0, group_lag.max())) + 1):
        out[f"stream/token_staleness_{j}"] = float((token_lag == j).float().mean()) if token_lag.numel() else 0.0
        out[f"stream/group_staleness_{j}"] = float((group_lag == j).float().mean())
    return out


def _clip_ratio(batch: Batch, lengths, width: int) -> float:
    """Share of rows cut by a length budget: as long as the batch is wide, or for episodes, ended
    by the length of a turn or of the context (observations make rows wider than their tokens)."""
    if AGENT_TRUNCATION in batch:
        return float(np.mean([str(t) in ("length", "context") for t in batch[AGENT_TRUNCATION]]))
    return float((lengths >= width).float().mean())


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Multi-turn episodes (`raygraph.agents`): turns per episode, tool calls by outcome (per
    episode), seconds in environment steps and tools, and the share of episodes ended by each
    truncation reason (`agent/truncated/<reason>`, "none" = the episode finished), and the share of
    episodes another rollout rank ran (`agent/ran_elsewhere`; 0 unless `dispatch: least_loaded`)."""
    turns = batch[AGENT_TURNS].float()
    out = {"agent/turns_mean": float(turns.mean()), "agent/turns_max": float(turns.max()),
           "agent/env_s_mean": float(batch[AGENT_ENV_S].float().mean())}
    for key, name in ((AGENT_TOOL_OK, "ok"), (AGENT_TOOL_ERROR, "error"), (AGENT_TOOL_TIMEOUT, "timeout")):
        out[f"agent/tool_calls_{name}"] = float(batch[key].float().mean())
    if AGENT_ELSEWHERE in batch:
        out["agent/ran_elsewhere"] = float(batch[AGENT_ELSEWHERE].float().mean())
    reasons = list(batch[AGENT_TRUNCATION])
    for reason in TRUNCATIONS:
        out[f"agent/truncated/{reason}"] = reasons.count(reason) / len(reasons)
    return out


def validation_metrics(batch: Batch) -> dict[str, float]:
    """Greedy validation: `val/accuracy` (mean of the reward's `acc`, else score > 0) and reward.

    Accuracy is also broken down by `data_source` when the batch mixes several.
    """
    correct = _correct(batch)
    out = {"val/accuracy": float(correct.mean()), "val/samples": float(len(batch))}
    out.update(_reward_summary(batch, "val/reward"))
    if "data_source" in batch:
        sources = np.asarray(batch["data_source"])
        if len(set(sources)) > 1:
            for source in sorted(set(sources)):
                rows = torch.as_tensor(sources == source)
                out[f"val/accuracy@{source}"] = float(correct[rows].mean())
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: `1 - C(n-c, k) / C(n, k)`
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _correct(batch: Batch) -> torch.Tensor:
    acc_col = f"{REWARD_EXTRA_PREFIX}acc"
    return batch[acc_col].float() if acc_col in batch else (sequence_scores(batch) > 0).float()


def sampled_validation_metrics(batch: Batch, *, n: int) -> dict[str, float]:
    """Sampled validation: `n` scored samples per prompt (rows of one prompt share a `uid`).

    Returns `val/pass@k` for k in 1, 2, 4, ... up to n (unbiased, `pass_at_k`, averaged over
    prompts) and `val/maj@n` (the most frequent answer, compared as stripped response text, is
    correct; ties go to the first sampled). With several data sources, each also per source
    (`val/pass@k@<source>`, `val/maj@n@<source>`).
    """
    correct, uids = _correct(batch).tolist(), list(batch[UID])
    answers = [" ".join(str(t).split()) for t in batch[RESPONSE_TEXT]] if RESPONSE_TEXT in batch else uids
    sources = list(batch[DATA_SOURCE]) if DATA_SOURCE in batch else ["all"] * len(uids)
    groups: dict = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    ks = sorted({1, n, *(2 ** j for j in range(1, n.bit_length()) if 2 ** j <= n)})
    per_prompt = []   # (source, {metric: value})
    for rows in groups.values():
        c = int(sum(correct[i] for i in rows))
        votes = collections.Counter(answers[i] for i in rows)
        top = max(votes.values())
        majority = next(answers[i] for i in rows if votes[answers[i]] == top)
        values = {f"pass@{k}": pass_at_k(len(rows), c, k) for k in ks}
        values[f"maj@{n}"] = float(any(correct[i] for i in rows if answers[i] == majority))
        per_prompt.append((sources[rows[0]], values))
    out = {f"val/{name}": float(np.mean([v[name] for _, v in per_prompt])) for name in per_prompt[0][1]}
    if len({source for source, _ in per_prompt}) > 1:
        for source in sorted({source for source, _ in per_prompt}):
            mine = [v for s, v in per_prompt if s == source]
            out.update({f"val/{name}@{source}": float(np.mean([v[name] for v in mine])) for name in mine[0]})
    return out


def sample_records(batch: Batch, rows: int = -1) -> list[dict]:
    """The first `rows` rows (-1: all) as plain records for a JSONL dump or the console.

    Each record: `uid`, `prompt`, `response`, `score` (the row's summed token scores), the
    reward's extras (`acc`, ...), and where present `advantage` (mean over the response tokens),
    `weight_version`, `response_length`, `data_source`, `ground_truth`, an LLM judge's `judge_prompt`
    and `judge_output`; multi-turn rows add
    `conversation` (role, text, tokens, reward per message) and `truncation`.
    """
    n = len(batch) if rows < 0 else min(rows, len(batch))
    scores = sequence_scores(batch)[:n].tolist() if TOKEN_LEVEL_SCORES in batch else [None] * n
    extras = {name[len(REWARD_EXTRA_PREFIX):]: batch[name][:n].float().tolist()
              for name in batch.tensors if name.startswith(REWARD_EXTRA_PREFIX)}
    mask = batch[RESPONSE_MASK][:n].float()
    columns: dict[str, list] = {}
    if ADVANTAGES in batch:
        adv = (batch[ADVANTAGES][:n].float() * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        columns["advantage"] = adv.tolist()
    for key, name in ((WEIGHT_VERSION, "weight_version"), (RESPONSE_LENGTH, "response_length")):
        if key in batch:
            columns[name] = batch[key][:n].tolist()
    for key, name in ((PROMPT_TEXT, "prompt"), (RESPONSE_TEXT, "response"), (DATA_SOURCE, "data_source"),
                      (GROUND_TRUTH, "ground_truth"), (JUDGE_PROMPT, JUDGE_PROMPT), (JUDGE_OUTPUT, JUDGE_OUTPUT)):
        if key in batch:
            columns[name] = [_plain(v) for v in batch[key][:n]]
    if AGENT_CONVERSATION in batch:   # multi-turn: the episode turn by turn
        columns["conversation"] = [list(c) for c in batch[AGENT_CONVERSATION][:n]]
        columns["truncation"] = [str(t) for t in batch[AGENT_TRUNCATION][:n]]
    uids = [_plain(u) for u in batch[UID][:n]] if UID in batch else list(range(n))
    return [{"uid": uids[i], "score": scores[i], **{k: v[i] for k, v in extras.items()},
             **{k: v[i] for k, v in columns.items()}} for i in range(n)]


def _plain(value):
    """numpy scalars and strings -> JSON-friendly Python values."""
    return value.item() if isinstance(value, np.generic) else value
