"""The engine side of `raygraph.workers.vllm_compat`: `WorkerExtension`, mixed into vLLM's worker
class (`worker_extension_cls`), runs in each engine worker (the rollout worker's process when the
engine core runs there, `raygraph.workers.vllm_in_process`) and is reached through
`LLM.collective_rpc`: error recording, the orphan guard, logit scaling and weight loading."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from raygraph.workers.vllm_deaths import FirstError, exit_when_orphaned
from raygraph.workers.vllm_staging import shared_tensors

__all__ = ["WorkerExtension", "own_buffered_tensors"]


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in each engine worker
    process and is reached through `LLM.collective_rpc`. Method names are prefixed so they
    cannot collide with the worker's own (vLLM asserts that)."""

    def raygraph_record_errors(self, path: str) -> None:
        """Write the first exception logged by vLLM in this process (`vllm_deaths.watch_engine`)."""
        logging.getLogger("vllm").addHandler(FirstError(path))

    def raygraph_exit_when_orphaned(self) -> None:
        """Die with the process that started the engine (`vllm_deaths.exit_when_orphaned`)."""
        exit_when_orphaned()

    def raygraph_scale_logits(self, factor: float) -> None:
        processor = getattr(self.model_runner.get_model(), "logits_processor", None)
        if processor is None or not hasattr(processor, "scale"):
            raise RuntimeError(f"{type(self.model_runner.get_model()).__name__} has no LogitsProcessor "
                               f"with a `scale`: raygraph cannot apply the sampling temperature")
        base = processor.__dict__.setdefault("_raygraph_base_scale", processor.scale)
        processor.scale = base * factor

    def raygraph_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        _quiet_known_reload_warnings()

        model = self.model_runner.get_model()
        _skip_packing_lookup_only_embeddings(model)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)

    def raygraph_load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights(weights=weights)

    def raygraph_load_bucket(self, wire: list[tuple[str, str, list[int], bytes]]) -> None:
        self.raygraph_load_weights(_from_wire(wire))

    def raygraph_load_tensors(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """A bucket handed over in memory (the engine core in the caller's process); the caller
        may reuse its memory once this returns."""
        self.raygraph_load_weights(iter(bucket))
        own_buffered_tensors()

    def raygraph_load_shared(self, path: str, nbytes: int, layout: list) -> None:
        self.raygraph_load_weights(shared_tensors(path, nbytes, layout))

    def raygraph_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            _reprocess_tied_layers(model)
        self.model_runner.reset_encoder_cache()


def own_buffered_tensors() -> list[str]:
    """Replace every tensor that vLLM's layerwise reload still buffers by a copy of it.

    The reload keeps the loader arguments of a layer until the layer's last tensor has arrived (a
    layer split over two buckets; attention layers until the end of the update) and builds the
    layer from them then, while the caller may overwrite a bucket's memory as soon as the load
    call returns (a transport's reused segment). A layer that a bucket completes is built during
    the call and keeps nothing, so only what a layer still waits with is copied, once (copies are
    marked): not, e.g., SmolLM2's 113 MB embedding, whose vocabulary vLLM does not pad.
    Returns the class of the layer of each tensor copied.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    copied: list[str] = []

    def owned(value, layer):
        if isinstance(value, (tuple, list)):   # a loader's *args
            return type(value)(owned(v, layer) for v in value)
        if isinstance(value, dict):            # a loader's **kwargs
            return {k: owned(v, layer) for k, v in value.items()}
        if (not isinstance(value, torch.Tensor) or value.device.type == "meta"
                or getattr(value, "_raygraph_owned", False)):
            return value
        copy = value.clone()
        copy._raygraph_owned = True
        copied.append(type(layer).__name__)
        return copy

    with torch.no_grad():
        for layer, info in list(LAYERWISE_INFO.items()):
            for _, bound in info.loaded_weights:
                for key, value in list(bound.arguments.items()):
                    if key != "param":
                        bound.arguments[key] = owned(value, layer)
    return copied


class _KnownReloadWarnings(logging.Filter):
    """Drops the reload's per-update "<Layer>: Failed to load weights" warning for layers that
    hold no checkpoint tensors (rotary embeddings) or are tied and reprocessed here (lm_head)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


def _quiet_known_reload_warnings() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("vllm.model_executor.model_loader"):
            target = logging.getLogger(name)
            if not any(isinstance(f, _KnownReloadWarnings) for f in target.filters):
                target.addFilter(_KnownReloadWarnings())


def _reprocess_tied_layers(model: torch.nn.Module) -> None:
    """Re-run weight post-processing on layers whose weight is another layer's (a tied lm_head).

    The layerwise reload processes the layer that loads a tied tensor (embed_tokens), not the
    layers sharing it; the CPU backend packs the lm_head's GEMM weight at processing time, so
    without this the logits would still come from the old embedding.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owner and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)
        owner.setdefault(id(weight), name)


def _skip_packing_lookup_only_embeddings(model: torch.nn.Module) -> None:
    """Reloads stop re-packing the GEMM weight of input embeddings, which only look rows up.

    On CPU, vLLM's embedding method packs a oneDNN GEMM copy of every vocabulary embedding's weight
    after loading (it is the same method as the LM head's, which multiplies by it); an input
    embedding never uses that copy (`F.embedding` reads the weight itself), so each reload packed
    SmolLM2's 113 MB embedding once for nothing (~40 ms of a ~0.5 s reload). A module that is also
    an LM head (a `ParallelLMHead`, or registered under a name ending in `lm_head`, as a tied head
    can be) keeps its packing; a tied `lm_head` is re-processed in `_reprocess_tied_layers`.
    Done once per model (the modules do not change between reloads).
    """
    if getattr(model, "_raygraph_embeddings_unpacked", False):
        return
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    heads = {id(m) for name, m in model.named_modules(remove_duplicate=False)
             if isinstance(m, ParallelLMHead) or name.rsplit(".", 1)[-1] == "lm_head"}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if (isinstance(module, VocabParallelEmbedding) and id(module) not in heads
                and isinstance(method, UnquantizedEmbeddingMethod)
                and "process_weights_after_loading" not in vars(method)):
            method.process_weights_after_loading = _keep_unpacked   # this layer's own method object
    model._raygraph_embeddings_unpacked = True


def _keep_unpacked(layer: torch.nn.Module) -> None:
    """`process_weights_after_loading` of an input embedding: its weight is used as loaded."""


def _from_wire(wire: list[tuple[str, str, list[int], bytes]]):
    for name, dtype, shape, data in wire:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        yield name, raw.view(getattr(torch, dtype)).reshape(shape)
