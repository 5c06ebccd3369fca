"""Rollout tokens/s: bare vLLM `LLM.generate`, `VLLMRolloutWorker.generate`, `HFRolloutWorker.generate`.

    python benchmarks/rollout_throughput.py [--model DIR | --size small] [--prompts 32] [--n 4]
        [--new-tokens 64] [--temperature 1.0] [--top-p 1.0] [--top-k 0] [--compile] [--engines ...]

All three sample the same prompts with the same sampling parameters (n samples per prompt, the
sampled tokens' log-probs returned). "vllm_bare" calls `LLM.generate` on the worker's own engine
(one request per prompt with `n`, token-id prompts, no detokenisation): the difference to
"vllm_worker" is the worker's cost (batch <-> requests, one seeded request per sample, padding,
response text). Rows may stop early on eos, so tokens are counted, not assumed. Each figure is the
best of `--repeats` timed runs after a warm-up; engine start-up is reported separately.

The default model is the tiny Qwen2 at size "small"; every preset has head_dim >= 32, which vLLM's
CPU attention needs. vLLM needs `if __name__ == "__main__"` (it spawns its engine). Logs go to
stderr; stdout is the JSON. The same engine inside training steps: `rollout_in_training.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_LENGTH, UID, Batch
from raygraph.models.loading import load_tokenizer
from raygraph.models.tiny import build_tiny_lm

ENGINES = ("vllm_bare", "vllm_worker", "hf_worker")


def _best(fn, repeats: int) -> tuple[float, int]:
    """`(best seconds, tokens of that run)` after one warm-up call; `fn` returns its token count."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        runs.append((time.perf_counter() - start, tokens))
    return min(runs)


def _figures(seconds: float, tokens: int) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}


def _prompts(path: str, count: int) -> Batch:
    tok = load_tokenizer(path)
    texts = [f"<|user|>What is {i} + {2 * i}?<|end|><|assistant|>" for i in range(count)]
    if tok.chat_template and "<|user|>" not in tok.chat_template:  # a real model: its own template
        texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                                         tokenize=False, add_generation_prompt=True) for i in range(count)]
    enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    return Batch({PROMPT_IDS: enc.input_ids, PROMPT_MASK: enc.attention_mask}, {UID: [str(i) for i in range(count)]})


def _run_vllm(args, path: str, prompts: Batch, sampling: dict) -> dict:
    from vllm import SamplingParams

    from raygraph.workers.rollout_vllm import VLLMRolloutWorker

    start = time.perf_counter()
    worker = VLLMRolloutWorker(model_path=path, dtype=args.dtype, n=args.n, enforce_eager=not args.compile,
                               **sampling)
    out = {"engine_start_s": round(time.perf_counter() - start, 2)}
    if "vllm_bare" in args.engines:
        ids, mask = prompts[PROMPT_IDS], prompts[PROMPT_MASK].bool()
        requests = [{"prompt_token_ids": ids[i][mask[i]].tolist()} for i in range(len(prompts))]
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.new_tokens, logprobs=0, detokenize=False)

        def bare() -> int:
            results = worker.engine.generate(requests, params, use_tqdm=False)
            return sum(len(c.token_ids) for r in results for c in r.outputs)

        out["vllm_bare"] = _figures(*_best(bare, args.repeats))
    if "vllm_worker" in args.engines:
        out["vllm_worker"] = _figures(*_best(lambda: int(worker.generate(prompts)[RESPONSE_LENGTH].sum()),
                                             args.repeats))
    worker.close()
    return out


def _run_hf(args, path: str, prompts: Batch, sampling: dict) -> dict:
    from raygraph.workers.rollout_hf import HFRolloutWorker

    worker = HFRolloutWorker(model_path=path, dtype=args.dtype, n=args.n, micro_batch_size=len(prompts) * args.n,
                             **sampling)
    return {"hf_worker": _figures(*_best(lambda: int(worker.generate(prompts)[RESPONSE_LENGTH].sum()),
                                         args.repeats)),
            "hf_device": str(worker.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local HF model directory (default: a tiny model built here)")
    parser.add_argument("--size", default="small", help="raygraph.models.tiny.TINY_SIZES key (head_dim >= 32)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="let vLLM torch.compile (default: eager)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the HF worker (vLLM sets its own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    torch.set_num_threads(args.threads)
    stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM and its engine processes log to stdout: send all of it to stderr
    sampling = {"max_new_tokens": args.new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(build_tiny_lm(tmp, size=args.size))
        prompts = _prompts(path, args.prompts)
        result = {"model": args.model or f"tiny:{args.size}", "dtype": args.dtype, "prompts": args.prompts,
                  "n": args.n, "sampling": sampling, "vllm_compile": args.compile, "hf_threads": args.threads,
                  "cpu_cores": os.cpu_count()}
        if {"vllm_bare", "vllm_worker"} & set(args.engines):
            import vllm

            result["vllm_version"] = vllm.__version__
            result.update(_run_vllm(args, path, prompts, sampling))
        if "hf_worker" in args.engines:
            result.update(_run_hf(args, path, prompts, sampling))
    import transformers

    result.update(torch=torch.__version__, transformers=transformers.__version__)
    sys.stdout.flush()
    os.dup2(stdout, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
