"""Memory of one training rank with LoRA vs full fine-tuning (policy + reference), on CPU.

    .venv/bin/python benchmarks/lora_memory.py --size 25m --rank 8
    .venv/bin/python benchmarks/lora_memory.py --model runs/models/smollm2-135m-instruct --rank 8

Each setting runs in a fresh process: it builds what a colocated GRPO rank with a KL term holds
for training (full: `PolicyWorker` + a `ReferenceWorker`; LoRA: one `PolicyWorker` whose base
without the adapter is the reference), runs one `update` on a small batch, then reads
* `rss_peak_mib`: the process's peak resident memory (ru_maxrss), and the growth over the
  process before any model was loaded (`rss_model_mib`);
* exact byte counts: trainable parameters, gradients + AdamW moments (optimizer_bytes),
  reference weights, and what one weight sync moves.
Prints one JSON object per setting.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measure(mode: str, model_path: str, rank: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from raygraph.batch import (
        ADVANTAGES,
        PROMPT_IDS,
        PROMPT_MASK,
        REF_LOGPROBS,
        RESPONSE_MASK,
        RESPONSES,
        Batch,
    )
    from raygraph.models.lora import LoraSpec
    from raygraph.workers.policy import PolicyWorker
    from raygraph.workers.reference import ReferenceWorker

    before = _rss_mib()
    start = time.perf_counter()
    lora = LoraSpec(rank=rank, alpha=2.0 * rank) if mode == "lora" else None
    policy = PolicyWorker(model_path=model_path, lr=1e-4, micro_batch_size=8, lora=lora)
    reference = None if lora else ReferenceWorker(model_path=model_path, micro_batch_size=8)
    gen = torch.Generator().manual_seed(0)
    ids = lambda: torch.randint(6, 90, (8, 32), generator=gen)  # noqa: E731
    ones = torch.ones(8, 32, dtype=torch.long)
    batch = Batch({PROMPT_IDS: ids(), PROMPT_MASK: ones, RESPONSES: ids(), RESPONSE_MASK: ones})
    ref = policy.ref_logprobs(batch) if lora else reference.logprobs(batch)
    batch = batch.union(ref).with_columns(**{ADVANTAGES: torch.randn(ref[REF_LOGPROBS].shape)})
    policy.update(batch)
    optimizer = policy.trained.optimizer
    states = [s for s in optimizer.state.values()]
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    sync = sum(t.numel() * t.element_size() for bucket in policy.weight_buckets() for _, t in bucket)
    queue.put({
        "mode": mode, "rss_peak_mib": round(_rss_mib(), 1), "rss_model_mib": round(_rss_mib() - before, 1),
        "trainable_params": sum(p.numel() for p in trainable),
        "weight_bytes": sum(p.numel() * p.element_size() for p in policy.model.parameters()),
        "grad_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer_bytes": sum(v.numel() * v.element_size() for s in states for v in s.values()
                               if torch.is_tensor(v) and v.dim() > 0),
        "reference_bytes": 0 if reference is None else sum(p.numel() * p.element_size()
                                                          for p in reference.model.parameters()),
        "sync_bytes": sync, "seconds": round(time.perf_counter() - start, 1),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m", help="tiny-model preset (raygraph.models.tiny.TINY_SIZES)")
    parser.add_argument("--model", default=None, help="a HF model directory instead of a tiny preset")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    from raygraph.models.tiny import build_tiny_lm

    model_path = args.model or str(build_tiny_lm(tempfile.mkdtemp(prefix="lora-mem-"), size=args.size))
    ctx = mp.get_context("spawn")
    for mode in ("full", "lora"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(mode, model_path, args.rank, queue))
        proc.start()
        result = queue.get()
        proc.join()
        print(json.dumps({"model": args.model or args.size, "rank": args.rank, **result}), flush=True)


if __name__ == "__main__":
    main()
