"""Small plain-Python stand-ins for the role workers (same method names as the real ones).

Weights are a few named float32 tensors; `generate` is a deterministic function of the weights
and the prompts, so layouts can be compared bit for bit without a model.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from raygraph.batch import OLD_LOGPROBS, PROMPT_IDS, RESPONSES, TOKEN_LEVEL_SCORES, UID, WEIGHT_VERSION, Batch


def make_weights(seed: int, sizes=(("embed", (16, 8)), ("layer.w", (8, 8)), ("layer.b", (8,)),
                                   ("head", (8, 4)))) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g) for name, shape in sizes}


def prompts(n_groups: int, per_group: int = 1, width: int = 5) -> Batch:
    ids = torch.arange(n_groups * per_group * width).reshape(-1, width) % 16
    uid = np.repeat([f"p{i}" for i in range(n_groups)], per_group)
    return Batch({PROMPT_IDS: ids}, {UID: uid})


class Policy:
    def __init__(self, seed: int = 0, big: int = 0):
        self.w = make_weights(seed)
        if big:
            self.w["big"] = torch.randn(big, generator=torch.Generator().manual_seed(seed + 1))
        import torch.distributed as dist

        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def weight_buckets(self, bucket_bytes: int = 1 << 20):
        """Like FSDP: every rank must walk the buckets (a collective per bucket)."""
        import torch.distributed as dist

        bucket, size = [], 0
        for name, t in self.w.items():
            if dist.is_initialized():
                dist.barrier()
            if bucket and size + t.numel() * 4 > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * 4
        if bucket:
            yield bucket

    def logprobs(self, batch: Batch) -> Batch:
        x = self.w["embed"][batch[RESPONSES] % 16].sum(-1)       # (B, R)
        return Batch({OLD_LOGPROBS: x})

    def update(self, batch: Batch, lr: float = 0.1) -> dict:
        import torch.distributed as dist

        grad = batch[TOKEN_LEVEL_SCORES].float().mean().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
        for t in self.w.values():
            t.add_(lr * grad)
        return {"actor/grad": float(grad), "actor/world": float(self.world)}

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.w.items()}

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def die(self) -> None:
        os._exit(1)

    def fail(self, message: str = "boom", batch: Batch | None = None) -> None:
        raise ValueError(message)

    def load_state(self, state: dict) -> None:
        for k, t in state.items():
            self.w[k].copy_(t)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        return torch.get_num_threads()

    def env(self) -> dict:
        import ray

        return {**{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                  "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM")},
                "runtime_env_vars": dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})}

    def hang(self, batch: Batch, seconds: float) -> Batch:
        return hang(batch, seconds)


class Rollout:
    def __init__(self, seed: int = 0, big: int = 0):
        self.w = make_weights(seed + 100)   # different from the policy until the first sync
        if big:
            self.w["big"] = torch.zeros(big)
        self.weight_version = 0

    def load_weights(self, buckets, version: int) -> None:
        for bucket in buckets:
            for name, t in bucket:
                self.w[name].copy_(t)
        self.weight_version = version

    def generate(self, batch: Batch, greedy: bool = False, n: int | None = None) -> Batch:
        h = self.w["embed"][batch[PROMPT_IDS]].sum(1) @ self.w["layer.w"] + self.w["layer.b"]   # (B, 8)
        logits = h @ self.w["head"]                                                          # (B, 4)
        resp = (logits * (1 if greedy else 3)).argsort(-1) + 1                                # (B, 4)
        out = batch.with_columns(**{RESPONSES: resp,
                                    WEIGHT_VERSION: torch.full((len(batch),), self.weight_version)})
        return out

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.w.items()}

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()


class Reward:
    def __init__(self):
        pass

    def score(self, batch: Batch) -> Batch:
        return Batch({TOKEN_LEVEL_SCORES: (batch[RESPONSES] == 1).float()})

    def pid(self) -> int:
        return os.getpid()


def advantages(batch: Batch, gamma: float = 1.0) -> Batch:
    """A module-level 'compute' function for roles.apply."""
    return batch.with_columns(advantages=batch[TOKEN_LEVEL_SCORES] * gamma)


def summarise(batch: Batch) -> dict:
    return {"rows": float(len(batch)), "score": float(batch[TOKEN_LEVEL_SCORES].sum()),
            "versions": sorted({int(v) for v in batch[WEIGHT_VERSION]})}


def hang(batch: Batch, seconds: float) -> Batch:
    time.sleep(seconds)
    return batch


def digest(batch: Batch) -> dict:
    """A small, exact fingerprint of a batch (what a test may bring back to the driver)."""
    return {"rows": len(batch), "columns": sorted(batch.columns()),
            "responses": batch[RESPONSES].tolist(), "uids": [str(u) for u in batch[UID]],
            "versions": batch[WEIGHT_VERSION].tolist()}


def explode(batch: Batch) -> Batch:
    """A whole-batch step that fails (errors must name the coordinator's work, not a role)."""
    raise KeyError("no such column: 'advantages'")
