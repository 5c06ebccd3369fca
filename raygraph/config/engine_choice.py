"""`rollout.engine: auto`, resolved by what makes a training *step* faster, as measured.

    engine, reason = auto_engine(cfg)      # ("hf", "the rollout runs on CPU and ...")

* Rollout on GPUs (its bundles have GPUs) and vLLM installed: **vllm**. vLLM's paged KV cache,
  continuous batching and CUDA graphs are what GPU rollouts are built on.
* Rollout on CPU: the engine of the faster GRPO step measured with `benchmarks/engine_choice.py`
  on 2 cores (docs/benchmarks.md, "Which engine makes the step faster"). vLLM's CPU build
  generates faster once a model has tens of millions of parameters, but its start, its weight
  reload every step and its engine overhead are paid whatever the length: it wins the step only
  when generation is a large share of it. **vllm** for models of >= `MIN_PARAMS` with
  `rollout.max_new_tokens` >= `MIN_NEW_TOKENS`, else **hf** (raygraph's KV-cached sampler).
* vLLM not installed: **hf**.

The choice and its reason are printed once at the start of a run (`raygraph.run.trainer`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raygraph.config.schema import RaygraphConfig

__all__ = ["MIN_NEW_TOKENS", "MIN_PARAMS", "approx_params", "auto_engine", "auto_engine_line", "rollout_gpus"]

MIN_PARAMS = 10e6       # measured: 1M (tiny preset "small") never won with vLLM; 25M and 135M did
MIN_NEW_TOKENS = 64     # measured: 16 and 48 tokens lost with vLLM at 25M and 135M; 64 and 128 won
_FIGURES = "docs/benchmarks.md, \"Which engine makes the step faster\""


def rollout_gpus(cfg: RaygraphConfig) -> float:
    """GPUs in each rollout worker's bundle (its own pool's, else the shared placement's)."""
    place = cfg.placement
    rollout_pool = (place.pools or {}).get(place.roles.get("rollout", ""))
    return rollout_pool.gpus_per_bundle if rollout_pool else place.gpus_per_worker


def approx_params(model_dir: str | Path) -> float | None:
    """Parameters of a decoder-only model from its config.json (embeddings, attention, MLP);
    None without a readable config (a hub id not downloaded yet)."""
    try:
        return _params(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _params(c: dict) -> float:
    hidden, layers, inter, vocab = (int(c[k]) for k in ("hidden_size", "num_hidden_layers",
                                                         "intermediate_size", "vocab_size"))
    kv = hidden * int(c.get("num_key_value_heads") or c["num_attention_heads"]) // int(c["num_attention_heads"])
    return float(vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter))


def auto_engine(cfg: RaygraphConfig) -> tuple[str, str]:
    """The engine `rollout.engine: auto` runs for `cfg`, and why (one sentence)."""
    if importlib.util.find_spec("vllm") is None:
        return "hf", "vLLM is not installed"
    if rollout_gpus(cfg) > 0:
        return "vllm", "the rollout runs on GPUs"
    params = approx_params(cfg.model.path)
    if params is None and cfg.model.tiny is not None:   # a tiny preset not built yet
        params = _preset_params(cfg.model.tiny)
    size = "a model of unknown size" if params is None else f"a ~{params / 1e6:.3g}M-parameter model"
    tokens = cfg.rollout.max_new_tokens
    vllm = (params is None or params >= MIN_PARAMS) and tokens >= MIN_NEW_TOKENS
    why = (f"the rollout runs on CPU with {size} and up to {tokens} new tokens, where "
           f"{'vLLM' if vllm else 'the HF sampler'} gave the faster training step ({_FIGURES})")
    return ("vllm", why) if vllm else ("hf", why + "; set rollout.engine=vllm to use vLLM")


def _preset_params(preset: str) -> float:
    from raygraph.models.tiny import TINY_SIZES, build_tiny_tokenizer

    hidden, layers, heads, kv_heads, inter = TINY_SIZES[preset]
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "intermediate_size": inter, "vocab_size": len(build_tiny_tokenizer())}
    return _params(config)


def auto_engine_line(cfg: RaygraphConfig) -> str | None:
    """What a run prints about its engine when `rollout.engine` is auto (None when it is set)."""
    if cfg.rollout.engine != "auto":
        return None
    engine, reason = auto_engine(cfg)
    return f"rollout.engine=auto -> {engine}: {reason}"
