"""A Hugging Face rollout engine: batched sampling with a KV cache, in plain PyTorch.

The sampling loop is written out (prefill, then one token per step with `cache=`) instead of
calling `generate`, so that the log-probs and stop handling are exactly what the trainer
assumes:

* `rollout_logprobs` are log-probs of the sampled tokens under `softmax(logits / temperature)`,
  the distribution the policy worker recomputes, **before** top-k / top-p truncation (those
  only restrict which tokens can be drawn; with them on, the sampler's true probabilities of
  the drawn tokens are higher than reported).
* a row stops after emitting eos (tokenizer and generation config) or any `stop_token_ids`;
  that token is part of the response (`response_mask` is 1 on it), later positions are padding.
* positions follow `raygraph.models.logprobs` (`cumsum(mask) - 1`), so the rollout's
  log-probs match the policy's recomputation of the same tokens to float tolerance.

Sampling draws from one `torch.Generator` per worker, seeded with `seed`: the same seed,
weights and call sequence give the same samples. Give each data-parallel rank its own seed.

Asynchronous pipelining (one-step off-policy): `prefetch_next` samples the next step's rollouts
with the weights held now and keeps them; `take_or_generate` hands them over one step later
(or samples now when nothing matching was prefetched); `raygraph.workers.prefetch` keeps them,
with the methods every engine shares (`raygraph.workers.rollout_engine`). The kept rollouts are
part of the checkpoint (safetensors + JSON, no pickle), so a resumed run continues with exactly
the rollouts it would have used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    Batch,
    pad_right,
)
from raygraph.models.loading import load_causal_lm, load_tokenizer
from raygraph.models.logprobs import position_ids_from_mask, prefill, prompt_runs
from raygraph.models.lora import LoraSpec, apply_lora
from raygraph.workers import rollout_engine
from raygraph.workers.agent_rollout import HFTurns, agent_loop, generate_episodes, no_episodes
from raygraph.workers.distributed import default_device
from raygraph.workers.prefetch import PrefetchedRollouts
from raygraph.workers.rollout_output import no_rollouts, rollout_rows
from raygraph.workers.streaming import Continuation, Sample

__all__ = ["HFRolloutWorker", "filter_top_k_top_p"]

Tensor = torch.Tensor


def filter_top_k_top_p(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) sets to -inf. `(B, V)` -> `(B, V)`.

    top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (Holtzman et al. 2020); the most likely token is always kept.
    """
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFRolloutWorker:
    """Generates responses for a batch of prompts with a Hugging Face causal LM.

    Args:
        model_path: local directory or hub id.
        dtype, attn_impl: see `raygraph.models.loading`.
        seed: seeds this worker's sampling generator.
        n: samples per prompt (default of `generate`).
        max_new_tokens: response length cap.
        temperature: > 0; logits are divided by it.
        top_p, top_k: nucleus / top-k truncation (1.0 / 0 = off).
        stop_token_ids: extra ids that end a response (eos always does).
        micro_batch_size: rows per forward pass.
        lora: the policy's LoRA adapters (docs/lora.md): this model gets the same (a fresh adapter
            changes nothing) and weight syncs load the adapter tensors only (`lora_sync_for`).
        device: default: the current CUDA device, else CPU.
        agent: multi-turn episodes instead of single responses: the `AgentLoop` arguments
            (`raygraph.agents.loop`, from `rollout.agent`); turns are generated in waves.
        partial_rollouts: streaming (`stream_submit`): a weight update lands between two decode
            steps and unfinished samples continue with it (true), or waits until the samples already
            started have finished (false); `raygraph.workers.streaming`.
    """

    @staticmethod
    def lora_sync_for(model_path: str, lora: LoraSpec) -> tuple[str, str]:
        """What the policy sends to this engine with LoRA: its adapter tensors (this engine holds
        the same adapters; `raygraph.workers.adapter`); and a line for the log."""
        return "adapter", "HF engine LoRA: adapter sync"

    def __init__(self, *, model_path: str, dtype: str = "float32", attn_impl: str = "auto", seed: int = 0,
                 n: int = 1, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: Sequence[int] = (), micro_batch_size: int = 64, lora: LoraSpec | None = None,
                 device: str | None = None, agent: dict | None = None, partial_rollouts: bool = True) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use generate(greedy=True) for argmax), got {temperature}")
        if not 0.0 < top_p <= 1.0 or top_k < 0 or max_new_tokens < 1 or n < 1:
            raise ValueError(f"need 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1, n >= 1; got "
                             f"{top_p}, {top_k}, {max_new_tokens}, {n}")
        self.device = default_device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, dtype=dtype, attn_impl=attn_impl).to(self.device)
        if lora is not None:
            self.model = apply_lora(self.model, lora).eval()
        self.model.requires_grad_(False)
        self.n, self.max_new_tokens, self.micro_batch_size = n, max_new_tokens, micro_batch_size
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.stop_token_ids = sorted({self.tokenizer.eos_token_id, *eos, *stop_token_ids} - {None})
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._weight_version = 0
        # held by each model call of a sampling loop and by `load_weights`: a streaming loop's
        # thread and a weight update never overlap (`raygraph.workers.streaming`)
        self._weights_lock = threading.Lock()
        self._no_update = threading.Event()  # cleared while `load_weights` waits and loads: streaming waves yield
        self._no_update.set()
        self.partial_rollouts, self.stream_wave_rows = partial_rollouts, micro_batch_size
        self.prefetched = PrefetchedRollouts()  # rollouts sampled ahead, by prompt uids
        self.streamed = None   # StreamedSamples, made by the first `stream_submit`
        self.agent = None if agent is None else agent_loop(agent, self.tokenizer, self.stop_token_ids, None)

    # seeding, pipelining and checkpoints: the same for every engine (`raygraph.workers.rollout_engine`)
    weight_version, reseed = rollout_engine.weight_version, rollout_engine.reseed
    prefetch, prefetch_next = rollout_engine.prefetch, rollout_engine.prefetch_next
    take_or_generate = rollout_engine.take_or_generate
    save_checkpoint, load_checkpoint = rollout_engine.save_checkpoint, rollout_engine.load_checkpoint
    # streaming rollouts (`raygraph.workers.streaming`)
    stream_submit, stream_load, stream_wait = rollout_engine.stream_submit, rollout_engine.stream_load, rollout_engine.stream_wait
    stream_take, stream_stop = rollout_engine.stream_take, rollout_engine.stream_stop

    def close(self) -> None:
        """Stop the agent loop's threads (multi-turn episodes) and a streaming loop."""
        if self.agent is not None:
            self.agent.shutdown()
        self.stream_stop()

    # ------------------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, batch: Batch, greedy: bool = False, n: int | None = None,
                 temperature: float | None = None) -> Batch:
        """Sample responses for the prompts of `batch`.

        Args:
            batch: `prompt_ids`, `prompt_mask` `(B, P)` plus any other columns (kept).
            greedy: argmax decoding (validation); `n` then defaults to 1.
            n: samples per prompt; default `self.n` (1 when greedy).
            temperature: sample at this temperature instead of the training one (sampled
                validation); `rollout_logprobs` are then under `softmax(logits / temperature)`.

        Returns:
            `B * n` rows (the n samples of a prompt contiguous, all input columns repeated,
            `uid` included) with `responses`, `response_mask` `(B*n, R)` (R = longest
            response), `response_length`, `rollout_logprobs`, `weight_version`,
            `response_text`.
        """
        n = n if n is not None else (1 if greedy else self.n)
        rows = batch.repeat_interleave(n) if n > 1 else batch
        if len(rows) == 0:
            return (no_rollouts if self.agent is None else no_episodes)(rows, self._weight_version)
        if self.agent is not None:
            return generate_episodes(self.agent, HFTurns(self, greedy, temperature), rows, [None] * len(rows),
                                     self._weight_version)
        pieces = [self.sample_tokens(rows[PROMPT_IDS][i:i + self.micro_batch_size],
                               rows[PROMPT_MASK][i:i + self.micro_batch_size], greedy,
                               temperature or self.temperature)
                  for i in range(0, len(rows), self.micro_batch_size)]
        width = max(p[0].shape[1] for p in pieces)
        pad = self.tokenizer.pad_token_id
        responses = torch.cat([pad_right(p[0], width, pad) for p in pieces])
        response_mask = torch.cat([pad_right(p[1], width, 0) for p in pieces])
        logprobs = torch.cat([pad_right(p[2], width, 0.0) for p in pieces])
        lengths = response_mask.sum(-1).tolist()
        texts = self.tokenizer.batch_decode([r[:k].tolist() for r, k in zip(responses, lengths)],
                                            skip_special_tokens=True)
        return rollout_rows(rows, responses, response_mask, logprobs, texts, self._weight_version)

    @torch.no_grad()
    def sample_tokens(self, prompt_ids: Tensor, prompt_mask: Tensor, greedy: bool, temperature: float,
                      max_new_tokens: int | None = None, *, budget: Tensor | None = None,
                      keep_going: Callable[[], bool] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """KV-cached decoding of one micro-batch -> `(responses, response_mask, logprobs)` on CPU.

        Args:
            max_new_tokens: tokens per row at most (default: the worker's).
            budget: `(B,)` tokens row by row at most (a continued sample has fewer left).
            keep_going: asked before each model call, under the weights lock; when it turns false
                the loop ends with what it sampled (a weight update ends a streaming wave), so
                every token returned was sampled with the weights held when the call began.
        """
        max_new_tokens = max_new_tokens or self.max_new_tokens
        keep = prompt_mask.bool().any(0).nonzero()
        start = int(keep[0]) if len(keep) else 0  # drop columns that are padding in every row
        prompt_ids, mask = prompt_ids[:, start:].to(self.device), prompt_mask[:, start:].long().to(self.device)
        rows = prompt_ids.shape[0]
        stop = torch.tensor(self.stop_token_ids, device=self.device)
        with self._weights_lock:
            if keep_going is not None and not keep_going():
                nothing = torch.zeros(rows, 0, dtype=torch.long)
                return nothing, nothing.clone(), nothing.float()
            # rows repeating a prompt (the n samples of each) share one prefill of it
            logits, cache = prefill(self.model, prompt_ids, mask, position_ids_from_mask(mask),
                                    prompt_runs(prompt_ids, mask))
        next_position = mask.sum(-1, keepdim=True)  # (B, 1): position of the first response token
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        budget = None if budget is None else budget.to(self.device)
        tokens, alive, logprobs = [], [], []
        for step in range(max_new_tokens):
            token, logprob = self._pick(logits, greedy, temperature)
            token = token.masked_fill(finished, self.tokenizer.pad_token_id)
            alive.append(~finished)
            tokens.append(token)
            logprobs.append(logprob.masked_fill(finished, 0.0))
            finished = finished | torch.isin(token, stop)
            if budget is not None:
                finished = finished | (budget <= step + 1)
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            with self._weights_lock:
                if keep_going is not None and not keep_going():
                    break
                out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position,
                                 cache=cache, use_cache=True)
            logits, cache = out.logits[:, -1], out.cache
            next_position = next_position + 1
        return (torch.stack(tokens, 1).cpu(), torch.stack(alive, 1).long().cpu(),
                torch.stack(logprobs, 1).float().cpu())

    def continue_samples(self, samples: Sequence[Sample], version: int,
                         keep_going: Callable[[], bool]) -> list[Continuation]:
        """One streaming wave: continue each sample from its token ids (prompt + tokens so far, as one
        left-padded sequence, so positions match the policy's) with the weights held now.

        `version` is the weight version the caller read; `keep_going` turns false when it changes,
        which ends the wave before the next model call (`sample_tokens`)."""
        seqs = [s.prompt_ids + s.tokens for s in samples]
        width, pad = max(map(len, seqs)), self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(q)) + q for q in seqs])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])
        budgets = [s.max_tokens or self.max_new_tokens for s in samples]
        left = torch.tensor([b - len(s.tokens) for b, s in zip(budgets, samples)])
        if int(left.min()) < 1:
            raise ValueError("continue_samples: a sample already has all its tokens but is not done")
        tokens, alive, logprobs = self.sample_tokens(ids, mask, False, self.temperature, int(left.max()),
                                                     budget=left, keep_going=keep_going)
        out = []
        for i, sample in enumerate(samples):
            k = int(alive[i].sum())
            new = tokens[i, :k].tolist()
            done = bool(new) and (new[-1] in self.stop_token_ids or len(sample.tokens) + k >= budgets[i])
            out.append(Continuation(new, logprobs[i, :k].tolist(), done))
        return out

    def _pick(self, logits: Tensor, greedy: bool, temperature: float) -> tuple[Tensor, Tensor]:
        """Next token `(B,)` and its log-prob under `softmax(logits / temperature)` `(B,)`."""
        scaled = logits.float() / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if greedy:
            token = scaled.argmax(-1)
        else:
            probs = torch.softmax(filter_top_k_top_p(scaled, self.top_k, self.top_p), dim=-1)
            token = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)

    # ------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        """Copy new weights in place, bucket by bucket (no second full copy of the model).

        Each bucket is checked (names, shapes) before any of it is copied; tensors are cast to
        this model's dtype and device. Tied parameters may be sent under either name.

        Returns:
            `{"loaded": number of tensors, "bytes": bytes received, "version": version}`.

        Raises:
            KeyError: a name that is not a parameter or buffer of this model.
            ValueError: a shape mismatch, naming the parameter.
        """
        self._no_update.clear()   # streaming: partial waves end at their next model call, none starts
        try:
            rollout_engine.drain_stream(self)   # without partial rollouts: the started samples finish first
            with self._weights_lock:   # never under a sampling loop's model call
                return self._copy_weights(buckets, version)
        finally:
            self._no_update.set()

    def _copy_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        targets = self.model.state_dict(keep_vars=True)
        loaded, nbytes = 0, 0
        for bucket in buckets:
            for name, tensor in bucket:
                if name not in targets:
                    raise KeyError(f"load_weights: unknown parameter {name!r}; the rollout model has "
                                   f"{len(targets)} tensors, e.g. {next(iter(targets))!r}")
                if tuple(tensor.shape) != tuple(targets[name].shape):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout "
                                     f"model expects {tuple(targets[name].shape)}")
            for name, tensor in bucket:
                targets[name].data.copy_(tensor)
                loaded += 1
                nbytes += tensor.numel() * tensor.element_size()
        self._weight_version = int(version)
        return {"loaded": loaded, "bytes": nbytes, "version": int(version)}


