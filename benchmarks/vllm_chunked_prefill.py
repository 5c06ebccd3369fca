"""What turning chunked prefill off costs on vLLM's CPU build (issue 29), in tokens/s.

    python benchmarks/vllm_chunked_prefill.py [--model DIR | --size small] [--prompts 64] [--n 4]
        [--prompt-tokens 200] [--new-tokens 32] [--repeats 2]

raygraph's engine on the CPU build runs with `enable_chunked_prefill=False` (`vllm_compat.build_engine`),
because a chunked prefill of a seeded request kills it. Two bare `vllm.LLM` engines, equal but
for that flag, sample the same prompts (`prompts x n` requests of `prompt-tokens` random token ids,
more in all than the 4096-token step budget): "chunked" unseeded (seeded it dies), "unchunked"
unseeded and seeded (raygraph's case). Figures: generated tokens/s and prompt+generated tokens/s,
best of `--repeats` after a warm-up. stdout is the JSON; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import psutil
import torch

from raygraph.models.tiny import build_tiny_lm


def _engine(model: str, chunked: bool):
    from vllm import LLM

    return LLM(model=model, dtype="float32", seed=0, enforce_eager=True, enable_chunked_prefill=chunked,
               kv_cache_memory_bytes=int(0.15 * psutil.virtual_memory().total), generation_config="vllm")


def _run(llm, prompts: list[list[int]], n: int, new_tokens: int, seeded: bool, repeats: int) -> dict:
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False,
                             seed=i if seeded else None) for i in range(len(requests))]
    runs = []
    for _ in range(repeats + 1):   # the first is a warm-up
        start = time.perf_counter()
        out = llm.generate(requests, params, use_tqdm=False)
        runs.append((time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in out)))
    seconds, generated = min(runs[1:])
    total = generated + sum(len(r["prompt_token_ids"]) for r in requests)
    return {"seconds": round(seconds, 3), "generated_tokens": generated,
            "generated_tokens_per_s": round(generated / seconds, 1), "all_tokens_per_s": round(total / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--size", default="small")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = args.model or str(build_tiny_lm(tempfile.mkdtemp() + "/m", size=args.size))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, min(vocab, 5000) - 3, (args.prompts, args.prompt_tokens), generator=g).tolist()
    result = {"model": model, "prompts": args.prompts, "n": args.n, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "prompt_tokens_per_call": args.prompts * args.n * args.prompt_tokens,
              "cpus": psutil.cpu_count(), "torch_threads": torch.get_num_threads()}
    for chunked in (True, False):
        llm = _engine(model, chunked)
        key = "chunked" if chunked else "unchunked"
        result[f"{key}_unseeded"] = _run(llm, prompts, args.n, args.new_tokens, False, args.repeats)
        if not chunked:
            result[f"{key}_seeded"] = _run(llm, prompts, args.n, args.new_tokens, True, args.repeats)
        llm.llm_engine.engine_core.shutdown()
        del llm
    base = result["chunked_unseeded"]["generated_tokens_per_s"]
    result["unchunked_seeded_vs_chunked"] = round(result["unchunked_seeded"]["generated_tokens_per_s"] / base, 3)
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    main()
