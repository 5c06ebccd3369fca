"""Throughput of the plain-PyTorch workers on a tiny model (CPU by default).

    python benchmarks/worker_throughput.py [--size tiny] [--prompts 32] [--new-tokens 16]

Prints one JSON object: rollout tokens/s (HFRolloutWorker.generate, KV-cached sampling),
policy log-prob samples/s (PolicyWorker.logprobs) and update samples/s (PolicyWorker.update,
one PPO epoch, token-mean). Each number is the best of `--repeats` timed runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from raygraph.batch import ADVANTAGES, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, UID, Batch
from raygraph.models.loading import load_tokenizer
from raygraph.models.tiny import build_tiny_lm
from raygraph.workers.policy import PolicyWorker
from raygraph.workers.rollout_hf import HFRolloutWorker


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny", help="raygraph.models.tiny.TINY_SIZES key")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny_lm(tmp, size=args.size))
        tok = load_tokenizer(path)
        texts = [f"<|user|>What is {i} + {2 * i}?<|end|><|assistant|>" for i in range(args.prompts)]
        enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        prompts = Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask},
                        {UID: [str(i) for i in range(args.prompts)]})

        rollout = HFRolloutWorker(model_path=path, max_new_tokens=args.new_tokens, seed=0, micro_batch_size=64)
        rollout.stop_token_ids = []  # no early stop: every row samples exactly --new-tokens tokens
        out = rollout.generate(prompts)
        rollout_s = _best_time(lambda: rollout.generate(prompts), args.repeats)
        tokens = int(out[RESPONSE_MASK].sum())

        policy = PolicyWorker(model_path=path, lr=1e-5, micro_batch_size=args.micro_batch_size)
        batch = out.union(policy.logprobs(out))
        batch = batch.with_columns(**{ADVANTAGES: torch.randn(batch[RESPONSE_MASK].shape)})
        logprobs_s = _best_time(lambda: policy.logprobs(batch), args.repeats)
        update_s = _best_time(lambda: policy.update(batch), args.repeats)

    rows = len(batch)
    print(json.dumps({
        "model_size": args.size,
        "params": sum(p.numel() for p in policy.model.parameters()),
        "threads": args.threads,
        "device": str(policy.device),
        "rollout": {"prompts": args.prompts, "new_tokens": args.new_tokens, "tokens": tokens,
                    "seconds": round(rollout_s, 4), "tokens_per_s": round(tokens / rollout_s, 1)},
        "policy_logprobs": {"samples": rows, "seconds": round(logprobs_s, 4),
                            "samples_per_s": round(rows / logprobs_s, 1)},
        "policy_update": {"samples": rows, "seq_len": int(batch[PROMPT_IDS].shape[1] + batch[RESPONSE_MASK].shape[1]),
                          "micro_batch_size": args.micro_batch_size, "seconds": round(update_s, 4),
                          "samples_per_s": round(rows / update_s, 1)},
    }, indent=2))


if __name__ == "__main__":
    main()
