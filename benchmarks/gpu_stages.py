"""The GRPO step's stages with the plain workers on ONE CUDA device, no Ray, no vLLM: what a lent GPU
machine (torch and transformers only) can measure of raygraph's own code.

    python benchmarks/gpu_stages.py [--sizes 25m 100m] [--prompts 32] [--n 8] [--new-tokens 128]
        [--dtype bfloat16] [--out gpu_stages.json] [--device cuda]

Per size (a random-init Qwen2 of `raygraph.models.tiny`, built here): `HFRolloutWorker.generate`
(prompts x n samples, up to `--new-tokens` each), `PolicyWorker.logprobs` (the old log-probs) and
its gap to the rollout's own log-probs on the sampled tokens (max / mean over response tokens: the
HF engine and the policy compute the same model in the same dtype), `PolicyWorker.update` (one
optimizer step over all rows, micro-batches of 32), `weight_buckets` + `HFRolloutWorker.load_weights`
(GB/s of the full-weight handover), and the device's peak memory. Each stage is timed after a
warm-up call, with `torch.cuda.synchronize()`. A failed stage is recorded with its error and the
others still run. Then, on the first size, the other workers' CUDA paths (`other_roles`): the
reference's log-probs against the policy's, a LoRA policy's update and its adapter-only buckets, the
critic's values and update. Prints one JSON line and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def _prompts(tokenizer, count: int):
    from raygraph.batch import PROMPT_IDS, PROMPT_MASK, UID, Batch
    from raygraph.data.prompts import left_pad

    texts = [f"{(7 * i) % 50}+{(3 * i) % 40}=" for i in range(count)]
    ids, mask = left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.pad_token_id)
    return Batch({PROMPT_IDS: ids, PROMPT_MASK: mask}, {UID: [f"p{i}" for i in range(count)]})


def one_size(size: str, args, root: Path) -> dict:
    from raygraph.batch import ADVANTAGES, OLD_LOGPROBS, RESPONSE_MASK, ROLLOUT_LOGPROBS
    from raygraph.models.tiny import build_tiny_lm
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.rollout_hf import HFRolloutWorker

    out: dict = {"size": size}
    path = build_tiny_lm(root / size, size=size)
    rollout = HFRolloutWorker(model_path=str(path), dtype=args.dtype, n=args.n, max_new_tokens=args.new_tokens,
                              micro_batch_size=args.prompts * args.n, device=args.device, seed=0)
    policy = PolicyWorker(model_path=str(path), dtype=args.dtype, lr=1e-5, micro_batch_size=32, device=args.device,
                          attn_impl="sdpa")
    out["params_m"] = round(sum(p.numel() for p in policy.model.parameters()) / 1e6, 1)
    prompts = _prompts(rollout.tokenizer, args.prompts)
    rollout.generate(prompts)   # warm-up
    rows, seconds = _timed(lambda: rollout.generate(prompts))
    tokens = int(rows[RESPONSE_MASK].sum())
    out["generate"] = {"s": round(seconds, 3), "rows": len(rows), "tokens": tokens, "tokens_per_s": round(tokens / seconds)}
    policy.logprobs(rows)   # warm-up
    scored, seconds = _timed(lambda: policy.logprobs(rows))
    mask = rows[RESPONSE_MASK].bool()
    gap = (scored[OLD_LOGPROBS] - rows[ROLLOUT_LOGPROBS]).abs()[mask]
    out["logprobs"] = {"s": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
                       "gap_to_rollout_max": round(float(gap.max()), 4), "gap_to_rollout_mean": round(float(gap.mean()), 5)}
    advantages = torch.randn(len(rows), 1).expand_as(rows[RESPONSE_MASK]).contiguous() * rows[RESPONSE_MASK]
    batch = rows.with_columns(**{OLD_LOGPROBS: scored[OLD_LOGPROBS], ADVANTAGES: advantages})
    policy.update(batch)   # warm-up (the optimizer's state is created here)
    stats, seconds = _timed(lambda: policy.update(batch))
    out["update"] = {"s": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
                     "grad_norm": round(float(stats["actor/grad_norm"]), 4)}
    buckets, seconds = _timed(lambda: list(policy.weight_buckets()))
    nbytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
    out["weight_buckets"] = {"s": round(seconds, 4), "gb": round(nbytes / 1e9, 3), "gb_per_s": round(nbytes / 1e9 / seconds, 2)}
    report, seconds = _timed(lambda: rollout.load_weights(buckets, version=1))
    out["load_weights"] = {"s": round(seconds, 4), "gb_per_s": round(nbytes / 1e9 / seconds, 2), "loaded": report["loaded"]}
    if args.device == "cuda":
        out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def other_roles(size: str, args, root: Path) -> dict:
    """The other workers' CUDA paths on one small model: the reference's log-probs (equal to the
    policy's at the same weights), a LoRA policy's update and adapter buckets, the critic's values
    and update."""
    from raygraph.batch import ADVANTAGES, OLD_LOGPROBS, REF_LOGPROBS, RESPONSE_MASK, RETURNS, VALUES
    from raygraph.models.lora import LoraSpec
    from raygraph.models.tiny import build_tiny_lm
    from raygraph.workers.critic import CriticWorker
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.reference import ReferenceWorker
    from raygraph.workers.rollout_hf import HFRolloutWorker

    out: dict = {"size": size}
    path = str(build_tiny_lm(root / f"{size}-roles", size=size))
    rollout = HFRolloutWorker(model_path=path, dtype=args.dtype, n=4, max_new_tokens=32, device=args.device)
    rows = rollout.generate(_prompts(rollout.tokenizer, 8))
    mask = rows[RESPONSE_MASK].bool()
    policy = PolicyWorker(model_path=path, dtype=args.dtype, lr=1e-5, micro_batch_size=16, device=args.device)
    reference = ReferenceWorker(model_path=path, dtype=args.dtype, micro_batch_size=16, device=args.device)
    gap = (policy.logprobs(rows)[OLD_LOGPROBS] - reference.logprobs(rows)[REF_LOGPROBS]).abs()[mask]
    out["reference_vs_policy_max"] = float(gap.max())
    advantages = torch.randn(len(rows), 1).expand_as(rows[RESPONSE_MASK]).contiguous() * rows[RESPONSE_MASK]
    lora = PolicyWorker(model_path=path, dtype=args.dtype, lr=1e-3, micro_batch_size=16, device=args.device,
                        lora=LoraSpec(rank=8))
    stats, seconds = _timed(lambda: lora.update(rows.with_columns(**{ADVANTAGES: advantages})))
    tensors = [t for bucket in lora.weight_buckets() for _, t in bucket]
    out["lora"] = {"update_s": round(seconds, 3), "grad_norm": round(float(stats["actor/grad_norm"]), 4),
                   "sync_tensors": len(tensors), "sync_mb": round(sum(t.numel() * t.element_size() for t in tensors) / 1e6, 3)}
    critic = CriticWorker(model_path=path, dtype=args.dtype, lr=1e-4, micro_batch_size=16, device=args.device)
    values = critic.values(rows)[VALUES]
    stats, seconds = _timed(lambda: critic.update(rows.with_columns(**{VALUES: values, RETURNS: advantages})))
    out["critic"] = {"update_s": round(seconds, 3), "vf_loss": round(float(stats["critic/vf_loss"]), 4),
                     "values_finite": bool(torch.isfinite(values[mask]).all())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["25m", "100m"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="gpu_stages.json")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_stages.py needs a CUDA device (--device cpu for a dry run)")
    import transformers

    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
                    "transformers": transformers.__version__, "config": vars(args), "sizes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            try:
                result["sizes"].append(one_size(size, args, Path(tmp)))
            except Exception as exc:  # noqa: BLE001 - one size's failure is a figure too
                result["sizes"].append({"size": size, "error": f"{type(exc).__name__}: {exc}",
                                        "traceback": traceback.format_exc()[-3000:]})
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        try:
            result["other_roles"] = other_roles(args.sizes[0], args, Path(tmp))
        except Exception as exc:  # noqa: BLE001 - reported
            result["other_roles"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    line = json.dumps(result)
    Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
