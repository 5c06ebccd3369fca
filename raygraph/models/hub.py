"""Whether a model named by a Hugging Face Hub id can be read here, without waiting on the network.

    hub_unreachable("Qwen/Qwen2.5-0.5B-Instruct")   # None, or why it cannot be read here

`raygraph validate` uses it to skip the checks that need a tokenizer (and say so) on a machine
that has neither the model in its Hugging Face cache nor the Hub within reach, instead of letting
the Hub client retry for ~40 s and calling it a data problem. `HF_HUB_OFFLINE` is respected; the
Hub (`HF_ENDPOINT`) is probed once with a short connection timeout.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

__all__ = ["hub_unreachable"]

_TRUE = ("1", "true", "yes", "on")


def hub_unreachable(repo_id: str, probe_timeout_s: float = 3.0, cache_dir: str | None = None) -> str | None:
    """None when `repo_id`'s tokenizer is in the local Hugging Face cache (`cache_dir`, default
    the usual one) or the Hub answers; otherwise why neither holds (one line)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "tokenizer_config.json", cache_dir=cache_dir)
    except ValueError:   # not shaped like a repo id: loading says what is wrong
        return None
    if isinstance(cached, str):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        return f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=probe_timeout_s).close()
    except OSError as exc:
        return f"{repo_id} is not in the local Hugging Face cache and {host}:{port} cannot be reached ({exc})"
    return None
