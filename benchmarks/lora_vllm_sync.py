"""LoRA policy -> vLLM engine: adapter syncs (vLLM's LoRA support) against merged weights, on CPU.

    .venv/bin/python benchmarks/lora_vllm_sync.py --size small --rank 4 --syncs 5

For each mode one `PolicyWorker` (LoRA) and one `VLLMRolloutWorker` (fp32, enforce_eager) on the
tiny model preset; each sync gives the adapters new random non-zero values (B is zero at init),
sends them through the verified in-process transport, then samples 6 rows of `--tokens` tokens.
Prints one JSON object per mode: bytes per sync, median sync and generate seconds, and the largest
|engine log-prob - policy log-prob| over every sampled token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

PROMPTS = ["<|user|>1+1=?<|end|><|assistant|>", "<|user|>x<|end|><|assistant|>", "<|user|>abc?<|end|><|assistant|>"]


def _measure(mode: str, path: str, rank: int, syncs: int, tokens: int) -> dict:
    from raygraph.batch import OLD_LOGPROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, ROLLOUT_LOGPROBS, Batch
    from raygraph.cluster.weights import InProcessTransport
    from raygraph.models.loading import load_tokenizer
    from raygraph.models.lora import LoraSpec, is_adapter_name
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    spec = LoraSpec(rank=rank, alpha=16.0)
    policy = PolicyWorker(model_path=path, lr=1e-2, temperature=0.8, lora=spec, lora_sync=mode)
    engine = VLLMRolloutWorker(model_path=path, seed=3, n=2, temperature=0.8, max_new_tokens=tokens,
                               enforce_eager=True, lora=spec, lora_sync=mode)
    enc = load_tokenizer(path)(PROMPTS, padding=True, return_tensors="pt", add_special_tokens=False)
    prompts = Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask})
    sync_s, generate_s, gap, stats = [], [], 0.0, {}
    try:
        for version in range(1, syncs + 1):
            gen = torch.Generator().manual_seed(version)
            for name, param in policy.model.named_parameters():
                if is_adapter_name(name):
                    param.data.copy_(0.1 * torch.randn(param.shape, generator=gen))
            start = time.perf_counter()
            transport = InProcessTransport()
            transport.send(policy.weight_buckets(bucket_bytes=1 << 20), version=version)
            stats = transport.receive(engine.load_weights)
            sync_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = engine.generate(prompts)
            generate_s.append(time.perf_counter() - start)
            diff = (policy.logprobs(out)[OLD_LOGPROBS] - out[ROLLOUT_LOGPROBS]).abs() * out[RESPONSE_MASK]
            gap = max(gap, float(diff.max()))
    finally:
        engine.close()
    return {"mode": mode, "bytes_per_sync": int(stats["weights/bytes"]), "verified": stats["weights/verified"],
            "sync_s_median": round(statistics.median(sync_s), 4),
            "generate_s_median": round(statistics.median(generate_s), 4), "max_abs_logprob_gap": gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="tiny model preset (head_dim 32 for vLLM's CPU attention)")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    from raygraph.models.lora import LoraSpec
    from raygraph.models.tiny import build_tiny_lm
    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    path = str(build_tiny_lm(f"{tempfile.mkdtemp()}/model", size=args.size, seed=0))
    print(VLLMRolloutWorker.lora_sync_for(path, LoraSpec(rank=args.rank, alpha=16.0))[1])
    for mode in ("adapter", "merged"):
        print(json.dumps(_measure(mode, path, args.rank, args.syncs, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
