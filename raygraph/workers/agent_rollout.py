"""Multi-turn rollouts on either engine (`rollout.agent`): the engines as `TurnEngine`s of the
agent loop (`raygraph.agents.loop`), and episodes as batch rows.

An episode is one row: its first prompt is the row's prompt, and everything after it (model turns,
tool results, observations, template tokens) is the row's response, with `response_mask` 1 on the
model's tokens only, `response_attention` 1 on all, `rollout_logprobs` 0 off the model's tokens and
`env_scores` holding the environment's rewards on the last token of the turn they follow
(`raygraph.agents.episode`). Per-episode facts go in the `agent_*` columns (`raygraph.batch`).

* vLLM (`VLLMTurns`): every turn is its own request, submitted as soon as it is known and run by
  the engine's continuous batching; one seed per turn (`Episode.turn_seed`).
* HF (`HFTurns`): turns are generated in waves (`lock_step`), with the worker's sampler.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from raygraph.agents.episode import Episode
from raygraph.agents.loop import AgentLoop
from raygraph.agents.program import ProgramLoop
from raygraph.batch import (
    AGENT_CONVERSATION,
    AGENT_ELSEWHERE,
    AGENT_ENV_S,
    AGENT_TOOL_ERROR,
    AGENT_TOOL_OK,
    AGENT_TOOL_TIMEOUT,
    AGENT_TRUNCATION,
    AGENT_TURNS,
    DATA_SOURCE,
    ENV_SCORES,
    EXTRA_INFO,
    GROUND_TRUTH,
    PROMPT_IDS,
    PROMPT_MASK,
    PROMPT_MESSAGES,
    PROMPT_TEXT,
    RESPONSE_ATTENTION,
    UID,
    Batch,
)
from raygraph.data.prompts import left_pad
from raygraph.workers import vllm_compat
from raygraph.workers.agent_dispatch import Dispatch, dispatch_tag, shared_episodes
from raygraph.workers.rollout_output import no_rollouts, rollout_rows

__all__ = ["no_episodes", "HFTurns", "VLLMTurns", "agent_loop", "env_row", "episode_rows", "generate_episodes",
           "run_episodes"]

_request_ids = itertools.count()


class VLLMTurns:
    """A `VLLMRolloutWorker`'s engine, one request per turn."""
    lock_step = False

    def __init__(self, worker, greedy: bool, temperature: float | None) -> None:
        self.worker, self.greedy = worker, greedy
        self.relative_temperature = (temperature or worker.temperature) / worker.temperature
        self._keys: dict[str, int] = {}

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        w = self.worker
        params = vllm_compat.sampling_params(greedy=self.greedy, top_p=w.top_p, top_k=w.top_k, max_tokens=max_tokens,
                                             stop_token_ids=w.stop_token_ids, seed=seed,
                                             temperature=self.relative_temperature)
        request_id = f"agent-{next(_request_ids)}"
        with vllm_compat.engine_guard(w._errors):
            vllm_compat.add_token_request(w.engine, request_id, prompt, params, lora=w._lora)
        self._keys[request_id] = key

    def pending(self) -> int:
        return len(self._keys)

    def poll(self) -> list[tuple[int, list[int], list[float]]]:
        with vllm_compat.engine_guard(self.worker._errors):
            finished = vllm_compat.finished_requests(self.worker.engine)
        return [(self._keys.pop(request_id), tokens, logprobs) for request_id, tokens, logprobs in finished]

    def abort(self) -> None:
        if self._keys:
            vllm_compat.abort_requests(self.worker.engine, list(self._keys))
            self._keys.clear()


class HFTurns:
    """An `HFRolloutWorker`'s sampler: every queued turn in one wave per `poll`."""
    lock_step = True

    def __init__(self, worker, greedy: bool, temperature: float | None) -> None:
        self.worker, self.greedy = worker, greedy
        self.temperature = temperature or worker.temperature
        self._queue: list[tuple[int, list[int], int]] = []

    def submit(self, key: int, prompt: list[int], max_tokens: int, seed: int | None) -> None:
        self._queue.append((key, prompt, max_tokens))

    def abort(self) -> None:
        self._queue.clear()

    def pending(self) -> int:
        return len(self._queue)

    def poll(self) -> list[tuple[int, list[int], list[float]]]:
        wave, self._queue = sorted(self._queue), []   # by episode: the same order whatever the timing
        out, size = [], self.worker.micro_batch_size
        for start in range(0, len(wave), size):
            part = wave[start:start + size]
            ids, mask = left_pad([prompt for _, prompt, _ in part], self.worker.tokenizer.pad_token_id)
            tokens, alive, logprobs = self.worker.sample_tokens(ids, mask, self.greedy, self.temperature,
                                                          max_new_tokens=max(room for _, _, room in part))
            for row, (key, _, room) in enumerate(part):
                length = min(int(alive[row].sum()), room)
                out.append((key, tokens[row, :length].tolist(), logprobs[row, :length].tolist()))
        return out


def env_row(rows: Batch, i: int) -> dict:
    """Row `i` as its environment sees it: the dataset row's fields."""
    def column(name, default=None):
        return rows[name][i] if name in rows else default
    return {"prompt": column(PROMPT_MESSAGES), "prompt_text": column(PROMPT_TEXT), "data_source": column(DATA_SOURCE),
            "reward_model": {"ground_truth": column(GROUND_TRUTH)}, "extra_info": column(EXTRA_INFO) or {},
            "uid": column(UID)}


def agent_loop(args: dict, tokenizer, stop_token_ids: Sequence[int],
               max_model_len: int | None) -> AgentLoop | ProgramLoop:
    """The engine's `AgentLoop` (or `ProgramLoop`, with `program`) from the `rollout.agent`
    arguments; its context budget must fit the engine's (`max_model_len`, None: no limit known).
    `groups_in_flight` (least-loaded dispatch, `raygraph.workers.agent_dispatch`) is the rank's,
    not the loop's: it is left out."""
    args = {k: v for k, v in args.items() if k != "groups_in_flight"}
    total = args["budgets"]["max_total_tokens"]
    if max_model_len is not None and total > max_model_len:
        raise ValueError(f"rollout.agent.max_total_tokens={total} exceeds the engine's max_model_len {max_model_len}: "
                         "lower it, or raise rollout.max_model_len")
    loop = ProgramLoop if args.get("program") else AgentLoop
    return loop(tokenizer=tokenizer, stop_token_ids=stop_token_ids, **args)


def generate_episodes(loop: AgentLoop, turns, rows: Batch, seeds: Sequence[int | None], weight_version: int,
                      dispatch: Dispatch | None = None) -> Batch:
    """One episode per row of `rows` (prompts already repeated n times), as rollout rows.

    With `dispatch` (least-loaded, `VLLMTurns` only), a share of a scattered step (`dispatch_tag`)
    is run with the other rollout ranks taking prompt groups by load
    (`raygraph.workers.agent_dispatch`); the rows are the same."""
    with torch.no_grad():
        episodes = run_episodes(loop, turns, rows, seeds, dispatch)
    if isinstance(loop, ProgramLoop):   # an episode's calls may be several rows (`raygraph.agents.program`)
        rows, episodes = program_rows(rows, episodes, loop.tokenizer)
    return episode_rows(rows, episodes, loop.tokenizer, weight_version) if episodes else \
        no_episodes(rows, weight_version)


def run_episodes(loop: AgentLoop, turns, rows: Batch, seeds: Sequence[int | None],
                 dispatch: Dispatch | None = None) -> list[Episode]:
    """One episode per row of `rows` (prompts already repeated n times)."""
    ids, mask = rows[PROMPT_IDS], rows[PROMPT_MASK].bool()
    prompts = [ids[i][mask[i]].tolist() for i in range(len(rows))]
    env_rows = [env_row(rows, i) for i in range(len(rows))]
    if dispatch is not None and (tag := dispatch_tag(rows)) is not None:
        settings = (turns.greedy, turns.relative_temperature)
        return shared_episodes(loop, turns, prompts, env_rows, seeds, rows, dispatch.round_of(tag, settings),
                               dispatch.window)
    return loop.run(turns, prompts, env_rows, seeds)


def program_rows(rows: Batch, episodes: Sequence[list[Episode]], tokenizer) -> tuple[Batch, list[Episode]]:
    """The dataset rows repeated once per row of their episode, with each row's own prompt (ids and
    text; the chat messages stay the dataset row's)."""
    owners = [i for i, parts in enumerate(episodes) for _ in parts]
    flat = [row for parts in episodes for row in parts]
    ids, mask = left_pad([row.prompt for row in flat], tokenizer.pad_token_id)
    texts = np.empty(len(flat), dtype=object)
    texts[:] = tokenizer.batch_decode([row.prompt for row in flat])
    return rows.select(owners).with_columns(**{PROMPT_IDS: ids, PROMPT_MASK: mask, PROMPT_TEXT: texts}), flat


def no_episodes(rows: Batch, weight_version: int) -> Batch:
    """What generating episodes from no prompts gives: the rollout columns and the episode columns,
    with no rows (a rank without a share, an empty refill round)."""
    empty = torch.zeros((0, 0), dtype=torch.int64)
    return no_rollouts(rows, weight_version).with_columns(**{
        RESPONSE_ATTENTION: empty.clone(), ENV_SCORES: torch.zeros((0, 0)),
        **{name: torch.zeros(0, dtype=torch.int64) for name in (AGENT_TURNS, AGENT_TOOL_OK, AGENT_TOOL_ERROR,
                                                                 AGENT_TOOL_TIMEOUT, AGENT_ELSEWHERE)},
        AGENT_ENV_S: torch.zeros(0), AGENT_TRUNCATION: np.empty(0, dtype=object),
        AGENT_CONVERSATION: np.empty(0, dtype=object)})


def episode_rows(rows: Batch, episodes: Sequence[Episode], tokenizer, weight_version: int) -> Batch:
    """`rows` with the rollout columns of their episodes (see the module docstring)."""
    width = max(1, *(len(ep.tokens) for ep in episodes))   # an agent program's episode may make no call
    shape = (len(episodes), width)
    responses = torch.full(shape, tokenizer.pad_token_id, dtype=torch.int64)
    mask, attention = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64)
    logprobs, scores = torch.zeros(shape), torch.zeros(shape)
    for i, ep in enumerate(episodes):
        k = len(ep.tokens)
        responses[i, :k] = torch.tensor(ep.tokens, dtype=torch.int64)
        mask[i, :k] = torch.tensor(ep.mask, dtype=torch.int64)
        attention[i, :k] = 1
        logprobs[i, :k] = torch.tensor(ep.logprobs)
        scores[i, :k] = torch.tensor(ep.rewards)
    model_tokens = [[t for t, m in zip(ep.tokens, ep.mask) if m] for ep in episodes]
    texts = tokenizer.batch_decode(model_tokens, skip_special_tokens=True)
    conversations = np.empty(len(episodes), dtype=object)
    conversations[:] = [ep.messages for ep in episodes]
    return rollout_rows(rows, responses, mask, logprobs, texts, weight_version).with_columns(**{
        RESPONSE_ATTENTION: attention, ENV_SCORES: scores,
        AGENT_TURNS: torch.tensor([ep.turns for ep in episodes], dtype=torch.int64),
        AGENT_ENV_S: torch.tensor([ep.env_s for ep in episodes], dtype=torch.float32),
        AGENT_TOOL_OK: torch.tensor([ep.tool_status["ok"] for ep in episodes], dtype=torch.int64),
        AGENT_TOOL_ERROR: torch.tensor([ep.tool_status["error"] for ep in episodes], dtype=torch.int64),
        AGENT_TOOL_TIMEOUT: torch.tensor([ep.tool_status["timeout"] for ep in episodes], dtype=torch.int64),
        AGENT_TRUNCATION: np.array([ep.truncation for ep in episodes], dtype=object),
        AGENT_ELSEWHERE: torch.tensor([int(ep.elsewhere) for ep in episodes], dtype=torch.int64),
        AGENT_CONVERSATION: conversations,
    })
