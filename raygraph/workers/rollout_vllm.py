"""A vLLM rollout engine: the contract of every engine (`raygraph.workers.rollout_engine`).

vLLM does the sampling (continuous batching, paged KV cache); this worker turns a `Batch` of
left-padded prompt ids into requests and the engine's outputs back into the batch layout every
role assumes (see `raygraph.workers.rollout_hf` for the conventions, repeated here briefly):

* `rollout_logprobs` are log-probs of the sampled tokens under `softmax(logits / temperature)`,
  **before** top-k / top-p truncation, the distribution the policy recomputes. vLLM 0.32 has no
  logprobs mode that is exactly that (`processed_logprobs` is after truncation), so the engine's
  logits are scaled by `1 / temperature` and requests sample at temperature 1 with
  `raw_logprobs` (see `vllm_compat`): the same samples, the right log-probs.
* a row stops after eos (tokenizer and generation config) or any `stop_token_ids`; that token
  is part of the response (`response_mask` 1 on it), later positions are padding.
* `n` samples of a prompt are `n` consecutive rows, each its own request with its own seed.

Seeds: one `torch.Generator` per worker, seeded with `seed`, draws one vLLM seed per sampled
row; the same seed, weights and call sequence give the same samples. Greedy rows use no seed.
A row's sample depends on its seed, prompt and the weights only, not on the other rows of the call.
On vLLM's CPU build the engine runs without chunked prefill, so seeded rows cannot kill it
(`vllm_compat.build_engine`); a dead engine raises `vllm_compat.RolloutEngineDied`.

Weights: `load_weights(buckets, version)` streams HF-named tensors into the running engine,
bucket by bucket (vLLM's layerwise reload re-packs each layer once all its tensors arrived).
An update must carry every tensor of the model, as the policy's `weight_buckets` does.
With LoRA (`lora`, `lora_sync="adapter"`, chosen by `lora_sync_for`) the engine runs vLLM's own
adapter support instead: an update carries the adapter tensors only, written as a PEFT directory
(`raygraph.workers.vllm_adapter`) and loaded under a new LoRA id per sync (the previous one is
removed), and every request runs with it. Without it (`lora_sync="merged"`) updates are merged
full weights, as above.

Prefetching and checkpoints are every engine's (`raygraph.workers.rollout_engine`):
safe formats only, tensors in safetensors, the other columns in JSON (numpy values become lists /
Python scalars; anything else JSON cannot hold is an error).

GPU-only options (`enable_sleep_mode`, `tensor_parallel_size`, `enable_prefix_caching`,
`gpu_memory_utilization`) go to the engine unchanged; on the CPU backend sleep mode raises
(`ValueError`) and `gpu_memory_utilization` is the share of host RAM given to the KV cache.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from raygraph.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    Batch,
)
from raygraph.models.loading import load_tokenizer
from raygraph.models.lora import LoraSpec
from raygraph.workers import rollout_engine, vllm_compat, vllm_in_process
from raygraph.workers.agent_dispatch import Dispatch, dispatch_tag
from raygraph.workers.agent_rollout import VLLMTurns, agent_loop, generate_episodes, no_episodes
from raygraph.workers.prefetch import PrefetchedRollouts
from raygraph.workers.rollout_output import no_rollouts, rollout_rows
from raygraph.workers.streaming import WAVE_TOKENS, Continuation, Sample
from raygraph.workers.vllm_adapter import AdapterSlot

__all__ = ["VLLMRolloutWorker"]

Tensor = torch.Tensor


class VLLMRolloutWorker:
    """Generates responses for a batch of prompts with a vLLM engine (`vllm.LLM`).

    Args:
        model_path: local directory or hub id.
        dtype: engine dtype ("float32", "bfloat16", ...).
        seed: seeds this worker's per-request seed generator (and the engine).
        n: samples per prompt (default of `generate`).
        max_new_tokens: response length cap.
        temperature: > 0; logits are divided by it.
        top_p, top_k: nucleus / top-k truncation (1.0 / 0 = off).
        stop_token_ids: extra ids that end a response (eos always does).
        max_model_len: prompt + response tokens per request (default: the model's); `generate`
            refuses prompts that leave less than `max_new_tokens` (vLLM would cut them short).
        tensor_parallel_size: engine ranks per replica.
        gpu_memory_utilization: share of device memory for weights + KV cache (CPU backend: share
            of host RAM for the KV cache); default 0.9 on GPU, 0.15 on CPU.
        enable_sleep_mode: free device memory between rollouts (GPU only; raises on CPU): after
            each `generate` the engine sleeps (weights offloaded, KV cache dropped) and it wakes for
            the next `generate` or `load_weights`, so colocated training gets the memory back.
        enable_prefix_caching: share the KV of repeated prompt prefixes (None: vLLM's default).
        enforce_eager: skip torch.compile / CUDA graphs (faster start, slower decode).
        max_num_seqs: requests decoded together (None: vLLM's default).
        lora: the policy's LoRA adapters (docs/lora.md); used only with `lora_sync="adapter"`.
        lora_sync: what the policy's syncs send, `lora_sync_for(model_path, lora)`: "adapter" (the
            engine serves the adapter with vLLM's LoRA support) or "merged" (full weights).
        agent: multi-turn episodes instead of single responses: the `AgentLoop` arguments
            (`raygraph.agents.loop`, from `rollout.agent`); each turn is its own request.
        engine_core: where vLLM's engine core runs (`raygraph.workers.vllm_in_process`): "auto"
            (in this process where possible), "in_process" or "own_process".
    """

    @staticmethod
    def lora_sync_for(model_path: str, lora: LoraSpec) -> tuple[str, str]:
        """What the policy sends to this engine with LoRA: "adapter" when the installed vLLM can
        serve the adapter (`vllm_compat.lora_support`), else "merged"; and a line for the log."""
        return _lora_sync(model_path, lora)

    def __init__(self, *, model_path: str, dtype: str = "float32", seed: int = 0, n: int = 1,
                 max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: Sequence[int] = (), max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                 enable_sleep_mode: bool = False, enable_prefix_caching: bool | None = None,
                 enforce_eager: bool = True, max_num_seqs: int | None = None, lora: LoraSpec | None = None,
                 lora_sync: str = "merged", agent: dict | None = None, engine_core: str = "auto",
                 partial_rollouts: bool = True) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use generate(greedy=True) for argmax), got {temperature}")
        if not 0.0 < top_p <= 1.0 or top_k < 0 or max_new_tokens < 1 or n < 1:
            raise ValueError(f"need 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1, n >= 1; got "
                             f"{top_p}, {top_k}, {max_new_tokens}, {n}")
        self.tokenizer = load_tokenizer(model_path)
        self.n, self.max_new_tokens = n, max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.stop_token_ids = sorted({self.tokenizer.eos_token_id, *_generation_eos(model_path),
                                      *stop_token_ids} - {None})
        self._shapes, self._alias = _weight_spec(model_path)
        if lora_sync not in ("adapter", "merged"):
            raise ValueError(f"unknown lora_sync {lora_sync!r}; valid: adapter, merged")
        self._adapter = AdapterSlot(model_path, lora) if lora is not None and lora_sync == "adapter" else None
        self._lora, self._lora_id = None, 0   # the LoRARequest in use (None: no adapter synced yet)
        self.engine = vllm_compat.build_engine(
            model_path=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
            max_lora_rank=None if self._adapter is None else lora.rank,
            in_process=vllm_in_process.resolve(engine_core, tensor_parallel_size))
        self._errors = vllm_compat.watch_engine(self.engine)
        if temperature != 1.0:
            vllm_compat.scale_logits(self.engine, 1.0 / temperature)
        self.max_model_len = vllm_compat.max_model_len(self.engine)
        self.agent = None if agent is None else agent_loop(agent, self.tokenizer, self.stop_token_ids, self.max_model_len)
        groups = (agent or {}).get("groups_in_flight")   # least-loaded dispatch (None: even)
        self._dispatch = None if groups is None else Dispatch(groups * n)   # the window counts episodes
        self.enable_sleep_mode, self._asleep = enable_sleep_mode, False
        self.generator = torch.Generator().manual_seed(seed)
        self._weight_version = 0
        self.prefetched = PrefetchedRollouts()  # rollouts sampled ahead, by prompt uids
        # streaming (`raygraph.workers.streaming`): every engine call holds the lock, so a
        # streaming loop's wave and a weight update (or a validation) never overlap
        self._weights_lock, self._no_update = threading.Lock(), threading.Event()
        self._no_update.set()
        self.streamed, self.partial_rollouts = None, partial_rollouts
        self.stream_wave_rows = max_num_seqs or 256   # vLLM batches the wave's requests itself

    # seeding, pipelining and checkpoints: the same for every engine (`raygraph.workers.rollout_engine`)
    weight_version, reseed = rollout_engine.weight_version, rollout_engine.reseed
    prefetch, prefetch_next = rollout_engine.prefetch, rollout_engine.prefetch_next
    take_or_generate = rollout_engine.take_or_generate
    save_checkpoint, load_checkpoint = rollout_engine.save_checkpoint, rollout_engine.load_checkpoint
    # streaming rollouts (`raygraph.workers.streaming`)
    stream_submit, stream_load, stream_wait = rollout_engine.stream_submit, rollout_engine.stream_load, rollout_engine.stream_wait
    stream_take, stream_stop = rollout_engine.stream_take, rollout_engine.stream_stop

    def close(self) -> None:
        """Stop the engine's processes (also happens when the worker is garbage-collected)."""
        self.stream_stop()
        if self.agent is not None:
            self.agent.shutdown()
        vllm_compat.shutdown(self.engine)
        if self._adapter is not None:
            self._adapter.close()

    # ------------------------------------------------------------------------------ generation
    def generate(self, batch: Batch, greedy: bool = False, n: int | None = None,
                 temperature: float | None = None) -> Batch:
        """Sample responses for the prompts of `batch`.

        Args:
            batch: `prompt_ids`, `prompt_mask` `(B, P)` plus any other columns (kept).
            greedy: argmax decoding (validation); `n` then defaults to 1.
            n: samples per prompt; default `self.n` (1 when greedy).
            temperature: sample at this temperature instead of the training one (sampled
                validation); `rollout_logprobs` stay under the training temperature then.

        Returns:
            `B * n` rows (the n samples of a prompt contiguous, all input columns repeated,
            `uid` included) with `responses`, `response_mask` `(B*n, R)` (R = longest
            response), `response_length`, `rollout_logprobs`, `weight_version`,
            `response_text`.

        Raises:
            RolloutEngineDied: the engine died (its root cause in the message); rebuild the worker.
        """
        n = n if n is not None else (1 if greedy else self.n)
        rows = batch.repeat_interleave(n) if n > 1 else batch
        if len(rows) == 0 and not (self.agent is not None and self._dispatch and dispatch_tag(rows)):
            return (no_rollouts if self.agent is None else no_episodes)(rows, self._weight_version)
        ids, mask = rows[PROMPT_IDS], rows[PROMPT_MASK].bool()
        prompts = [ids[i][mask[i]].tolist() for i in range(len(rows))]  # left padding dropped
        seeds = [None] * len(rows) if greedy else torch.randint(
            0, 2**31 - 1, (len(rows),), generator=self.generator).tolist()
        if self.agent is not None:
            with self._weights_lock:   # a streaming loop's waves (`raygraph.workers.streaming_episodes`) wait
                self._wake()
                out = generate_episodes(self.agent, VLLMTurns(self, greedy, temperature), rows, seeds,
                                        self._weight_version, self._dispatch)
                if self.enable_sleep_mode:
                    self.sleep()
            return out
        longest = max(map(len, prompts))
        if longest + self.max_new_tokens > self.max_model_len:  # vLLM would cut the response short
            raise ValueError(f"a prompt of {longest} tokens + max_new_tokens {self.max_new_tokens} exceeds the "
                             f"engine's max_model_len {self.max_model_len}; raise max_model_len or drop long prompts")
        params = [vllm_compat.sampling_params(greedy=greedy, top_p=self.top_p, top_k=self.top_k,
                                              max_tokens=self.max_new_tokens,
                                              stop_token_ids=self.stop_token_ids, seed=s,
                                              temperature=(temperature or self.temperature) / self.temperature)
                  for s in seeds]
        with self._weights_lock:
            self._wake()
            with vllm_compat.engine_guard(self._errors):
                outputs = vllm_compat.generate_tokens(self.engine, prompts, params, lora=self._lora)
            if self.enable_sleep_mode:
                self.sleep()
        width = max(len(tokens) for tokens, _ in outputs)
        responses = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.int64)
        response_mask = torch.zeros((len(rows), width), dtype=torch.int64)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, token_logprobs) in enumerate(outputs):
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            response_mask[i, :len(tokens)] = 1
            logprobs[i, :len(tokens)] = torch.tensor(token_logprobs, dtype=torch.float32)
        texts = self.tokenizer.batch_decode([tokens for tokens, _ in outputs], skip_special_tokens=True)
        return rollout_rows(rows, responses, response_mask, logprobs, texts, self._weight_version)

    def continue_samples(self, samples: Sequence[Sample], version: int,
                         keep_going: Callable[[], bool]) -> list[Continuation]:
        """One streaming wave: each sample's token ids so far (prompt + response) as a token-id
        prompt, at most `WAVE_TOKENS` more tokens each, with the weights held now. The wave runs
        as one engine call under the weights lock, so a weight update waits for it (one wave)
        and every token of it was sampled with `version`."""
        prompts = [s.prompt_ids + s.tokens for s in samples]
        left = [(s.max_tokens or self.max_new_tokens) - len(s.tokens) for s in samples]
        # each sample's own length: a long sample near its end beside a fresh one is fine
        longest = max(len(p) + k for p, k in zip(prompts, left))
        if longest > self.max_model_len:
            raise ValueError(f"a streamed sample of {longest} tokens (prompt + max_new_tokens) would exceed the "
                             f"engine's max_model_len {self.max_model_len}")
        seeds = torch.randint(0, 2**31 - 1, (len(samples),), generator=self.generator).tolist()
        params = [vllm_compat.sampling_params(greedy=False, top_p=self.top_p, top_k=self.top_k,
                                              max_tokens=min(k, WAVE_TOKENS), stop_token_ids=self.stop_token_ids,
                                              seed=seed, temperature=1.0)
                  for k, seed in zip(left, seeds)]
        with self._weights_lock:
            if not keep_going():
                return [Continuation([], [], False) for _ in samples]
            self._wake()
            with vllm_compat.engine_guard(self._errors):
                outputs = vllm_compat.generate_tokens(self.engine, prompts, params, lora=self._lora)
        return [Continuation(list(tokens), [float(x) for x in lps],
                             bool(tokens) and (tokens[-1] in self.stop_token_ids or len(tokens) >= k))
                for (tokens, lps), k in zip(outputs, left)]

    # ------------------------------------------------------------------------------ weights
    def load_weights(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        """Stream new weights into the running engine, bucket by bucket.

        Each bucket is checked (names, shapes) before any of it is sent; tied parameters may be
        sent under either name (once is enough). The update must contain every tensor of the
        model: vLLM re-packs a layer from the tensors it received.

        With adapter syncs (`lora_sync="adapter"`) the update is the adapter's tensors instead, every
        one of them, in the policy's peft names (`_load_adapter`).

        Returns:
            `{"loaded": number of tensors, "bytes": bytes received, "version": version}`.

        Raises:
            RolloutEngineDied: the engine died (its root cause in the message); rebuild the worker.
            KeyError: a name that is not a parameter or buffer of this model.
            ValueError: a shape mismatch, naming the parameter; or tensors missing at the end
                (the engine's weights are then inconsistent: send a full update).
        """
        self._no_update.clear()   # streaming: no wave starts until the update has landed
        try:
            rollout_engine.drain_stream(self)   # without partial rollouts: the started samples finish first
            with self._weights_lock, vllm_compat.engine_guard(self._errors):
                return self._load_adapter(buckets, version) if self._adapter is not None else \
                    self._load_full(buckets, version)
        finally:
            self._no_update.set()

    def _load_full(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        loaded, nbytes, seen = 0, 0, set()
        self._wake()
        vllm_compat.begin_weight_update(self.engine)
        try:
            for bucket in buckets:
                send = []
                for name, tensor in bucket:
                    canonical = self._check(name, tensor)
                    if canonical not in seen:  # a tied tensor sent under both names goes once
                        seen.add(canonical)
                        send.append((canonical, tensor))
                vllm_compat.load_bucket(self.engine, send)
                loaded += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        finally:
            vllm_compat.finish_weight_update(self.engine)
        missing = sorted(set(self._shapes) - seen)
        if missing:
            raise ValueError(f"load_weights: the update lacks {len(missing)} of the model's {len(self._shapes)} "
                             f"tensors, e.g. {missing[:3]}; vLLM needs whole layers: send every tensor")
        self._weight_version = int(version)
        return {"loaded": loaded, "bytes": nbytes, "version": int(version)}

    def _load_adapter(self, buckets: Iterable[list[tuple[str, Tensor]]], version: int) -> dict:
        """A new adapter under a new LoRA id (vLLM caches adapters by id: reusing one would serve
        the old tensors); the previous adapter leaves the engine and the disk."""
        loaded, nbytes = self._adapter.receive(buckets)
        self._wake()
        previous, self._lora_id = self._lora, self._lora_id + 1
        self._lora = vllm_compat.add_lora(self.engine, self._lora_id, self._adapter.write(self._lora_id))
        if previous is not None:
            vllm_compat.remove_lora(self.engine, previous.lora_int_id)
            self._adapter.drop(previous.lora_int_id)
        self._weight_version = int(version)
        return {"loaded": loaded, "bytes": nbytes, "version": int(version)}

    def _check(self, name: str, tensor: Tensor) -> str:
        canonical = self._alias.get(name, name)
        if canonical not in self._shapes:
            raise KeyError(f"load_weights: unknown parameter {name!r}; the rollout model has "
                           f"{len(self._shapes)} tensors, e.g. {next(iter(self._shapes))!r}")
        if tuple(tensor.shape) != self._shapes[canonical]:
            raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout "
                             f"model expects {self._shapes[canonical]}")
        return canonical

    # ------------------------------------------------------------------------------ memory
    def sleep(self, level: int = 1) -> None:
        """Free device memory between rollouts (level 1: offload weights, drop KV cache;
        level 2: drop weights too, reload them with `load_weights` after `wake_up`)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep() needs VLLMRolloutWorker(enable_sleep_mode=True) (GPU only)")
        vllm_compat.sleep(self.engine, level)
        self._asleep = True

    def wake_up(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("wake_up() needs VLLMRolloutWorker(enable_sleep_mode=True) (GPU only)")
        vllm_compat.wake_up(self.engine)
        self._asleep = False

    def _wake(self) -> None:
        if self._asleep:
            self.wake_up()


@functools.cache   # one decision per model and spec (the driver asks for the policy and the rollout)
def _lora_sync(model_path: str, lora: LoraSpec) -> tuple[str, str]:
    reason = vllm_compat.lora_support(model_path, lora.rank, lora.target_modules)
    if reason is None:
        return "adapter", f"vLLM LoRA: adapter sync ({AdapterSlot(model_path, lora).bytes} bytes per sync)"
    return "merged", f"vLLM LoRA: merged weights because {reason}"


def _generation_eos(model_path: str) -> list[int]:
    """eos ids of the model's generation config (what `HFRolloutWorker` stops on besides the
    tokenizer's eos)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: transformers derives one from the model config
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path)).eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _weight_spec(model_path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """`({state-dict name: shape}, {tied alias: canonical name})` of the HF model, built on the
    meta device (no memory). The canonical name of tied tensors is the first one (the input
    embedding), as the policy's `weight_buckets` sends it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    shapes, alias, first = {}, {}, {}
    persistent = set(model.state_dict())
    named = [*model.named_parameters(remove_duplicate=False),
             *((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)]
    for name, tensor in named:
        canonical = first.setdefault(id(tensor), name)
        if canonical == name:
            shapes[name] = tuple(tensor.shape)
        else:
            alias[name] = canonical
    return shapes, alias

