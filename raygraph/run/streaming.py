"""Streaming rollouts, the driver's side (`rollout.streaming`, docs/streaming.md).

The rollout ranks generate continuously (`raygraph.workers.streaming`); the driver keeps their
queues filled `placement.max_staleness` (k) steps ahead of training and hands each step the
finished groups of its own prompts:

    step s:  fill(s)  submit the prompts of step s + k, group by group to the least-loaded rank
                      (fewest unfinished samples), with the weights of version s - 1 in the engines
             take(s)  wait until every group of step s has finished; the step's graph then takes
                      them from the ranks that hold them (`rollout.stream_take`)

Prompts are drawn in the data order by a copy of the run's sampler that runs k steps ahead; the
run's own sampler draws each step's prompts when the step starts, as a synchronous run does, so
checkpoints, the sample ledger and resumes are those of a synchronous run. A resumed run submits
the prompts after its checkpoint again: the groups that were generating are generated again
(nothing lost, nothing trained twice), not restored.

Staleness is bounded by construction: the prompts of step s are submitted at the start of step
s - k, when the engines hold version s - k - 1, and step s updates version s - 1, so no token of a
step is more than k versions behind (with partial rollouts a sample may hold tokens of several
versions, all within that bound). Nothing is dropped or regenerated for staleness.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import defaultdict

from raygraph.batch import STREAM_TAKE, UID, Batch
from raygraph.run.feed import StepData

__all__ = ["StreamFeed"]


class StreamFeed:
    """Keeps the rollout ranks `ahead` steps ahead of training and hands each step its groups.

    Args:
        rollout: the rollout role (`raygraph.cluster.RoleGroup`) of ranks with the `stream_*` methods.
        data: the run's prompts; its sampler must be where the next step starts (after a resume).
        ahead: k = `placement.max_staleness`.
        n: samples per prompt (a rank's load counts samples).
        next_step: the first step this feed serves.
        last_step: the run's last step (`trainer.total_steps`): nothing beyond it is submitted.
        timeout_s: longest wait for a step's groups (`trainer.step_timeout_s`).
    """

    POLL_S = 2.0   # a wait is cut in slices so that a dead rank or a stuck loop is seen promptly

    def __init__(self, rollout, data: StepData, *, ahead: int, n: int, next_step: int, last_step: int,
                 timeout_s: float) -> None:
        self.rollout, self.ahead, self.n, self.last_step, self.timeout_s = rollout, ahead, n, last_step, timeout_s
        self.lookahead = dataclasses.replace(data, sampler=copy.deepcopy(data.sampler))
        self.next_step = next_step        # the next step whose prompts are submitted
        self.owner: dict[str, int] = {}   # uid -> the rank generating its group
        self.submitted: dict[int, list[str]] = {}   # step -> its uids, in data order

    def fill(self, step: int) -> dict[str, float]:
        """Submit the prompts of every step up to `step + ahead` not submitted yet; `stream/*` figures."""
        groups = 0
        while self.next_step <= min(step + self.ahead, self.last_step):
            prompts = self.lookahead.next_prompts(step=self.next_step, kl_coef=0.0)
            loads = [int(x) for x in self.rollout.call("stream_load")]
            shares: list[list[int]] = [[] for _ in loads]
            for row, uid in enumerate(prompts[UID]):
                rank = min(range(len(loads)), key=loads.__getitem__)
                shares[rank].append(row)
                loads[rank] += self.n
                self.owner[uid] = rank
            self.rollout.call_each("stream_submit", [(prompts.select(rows),) for rows in shares])
            self.submitted[self.next_step] = list(prompts[UID])
            self.next_step += 1
            groups += len(prompts)
        return {"stream/submitted_groups": float(groups)}

    def take(self, step: int, prompts: Batch) -> dict[str, float]:
        """Wait until every group of `prompts` (step `step`'s, drawn by the run's sampler) has
        finished, and tell the step's graph which rank holds which (`meta[STREAM_TAKE]`).

        Returns:
            `stream/wait_s` (the trainer's wait), `stream/rollout_busy_frac` (the ranks' generation
            time over wall time since the last step, mean of ranks), `stream/in_flight` (samples
            still generating: later steps'), `stream/queued_groups`, and tokens generated since
            the last step with the newest weights and with older ones.

        Raises:
            RuntimeError: the prompts differ from those submitted for the step (the two samplers
                diverged: a bug, never trained on). TimeoutError: not finished within `timeout_s`.
        """
        uids = list(prompts[UID])
        expected = self.submitted.pop(step, None)
        if uids != expected:
            raise RuntimeError(f"streaming: step {step}'s prompts {uids[:4]} are not the ones submitted for it "
                               f"({(expected or [])[:4]}); the feed and the run's sampler diverged")
        per_rank = defaultdict(list)
        for uid in uids:
            per_rank[self.owner.pop(uid)].append(uid)
        ranks = range(self.rollout.world_size)
        started, totals = time.perf_counter(), defaultdict(float)
        while True:
            results = self.rollout.call_each("stream_wait", [(per_rank[r], self.POLL_S) for r in ranks])
            for r, figures in enumerate(results):
                for key in ("busy_s", "wall_s"):
                    totals[f"{key}/{r}"] += figures.get(key, 0.0)
                newest = max((int(k[8:]) for k in figures if k.startswith("tokens_v")), default=0)
                for key, value in figures.items():
                    if key.startswith("tokens_v"):
                        totals["new" if int(key[8:]) == newest else "old"] += value
            if all(f["ready"] for f in results):
                break
            if time.perf_counter() - started > self.timeout_s:
                raise TimeoutError(f"streaming: the groups of step {step} did not finish within "
                                   f"{self.timeout_s:.0f}s (trainer.step_timeout_s)")
        prompts.meta[STREAM_TAKE] = {r: per_rank[r] for r in ranks}
        busy = [totals[f"busy_s/{r}"] / totals[f"wall_s/{r}"] for r in ranks if totals[f"wall_s/{r}"] > 0]
        return {"stream/wait_s": time.perf_counter() - started,
                "stream/rollout_busy_frac": sum(busy) / len(busy) if busy else 0.0,
                "stream/in_flight": sum(f.get("in_flight", 0.0) for f in results),
                "stream/queued_groups": sum(f.get("queued", 0.0) for f in results) - len(uids),
                "stream/tokens_newest_version": totals["new"], "stream/tokens_older_versions": totals["old"]}
