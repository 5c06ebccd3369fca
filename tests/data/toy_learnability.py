"""Evidence that the toy task is learnable by RL on 2 CPU cores (a script, not a pytest test).

    .venv/bin/python tests/data/toy_learnability.py --seeds 0 1 2

For each seed: build a random tiny model, write the toy data, run the copy warm start
(`warm_start.parquet`, no addition in it), then a minimal GRPO loop (group-normalised
advantages, PPO-clip, mini-batches) that uses only this package's data and reward code. Prints
held-out greedy accuracy at random init, after the warm start and during RL. It stands in for
the full trainer so that the task's design can be checked on its own; the numbers quoted in
`raygraph/data/toy.py` come from it.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raygraph.batch import ATTENTION_MASK, INPUT_IDS, LOSS_MASK, RESPONSE_MASK, RESPONSES, TOKEN_LEVEL_SCORES
from raygraph.data import PromptDataset, ResumableSampler, SFTDataset
from raygraph.data.toy import write_toy_dataset
from raygraph.models.tiny import build_tiny_lm
from raygraph.workers.reward_rule import RuleRewardWorker


def generate(model, tok, prompts, n, greedy, max_new_tokens):
    """(B*n, R) responses cut after the first eos, and their mask."""
    ids, mask = prompts["prompt_ids"], prompts["prompt_mask"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=n, pad_token_id=tok.pad_token_id)
    resp = out[:, ids.shape[1]:]
    eos = resp == tok.eos_token_id
    resp_mask = ((eos.cumsum(1) - eos.long()) == 0).long()      # up to and including the first eos
    return prompts.repeat_interleave(n).with_columns(**{RESPONSES: resp.masked_fill(resp_mask == 0, tok.pad_token_id),
                                                        RESPONSE_MASK: resp_mask})


def response_logprobs(model, batch):
    """(B, R) log-probs of the response tokens (left-padded prompts, right-padded responses)."""
    ids = torch.cat([batch["prompt_ids"], batch[RESPONSES]], 1)
    mask = torch.cat([batch["prompt_mask"], batch[RESPONSE_MASK]], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    p = batch["prompt_ids"].shape[1]
    return torch.log_softmax(logits[:, p - 1:-1].float(), -1).gather(-1, batch[RESPONSES][..., None]).squeeze(-1)


def accuracy(model, tok, reward, prompts):
    rollouts = generate(model.eval(), tok, prompts, 1, True, 4)
    return reward.score(rollouts)[TOKEN_LEVEL_SCORES].sum(1).mean().item()


def run(seed, args, workdir):
    torch.manual_seed(seed)
    path = build_tiny_lm(f"{workdir}/model{seed}", seed=seed)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    task_args = {} if args.max_operand is None else {"max_operand": args.max_operand}
    train_path, val_path = write_toy_dataset(f"{workdir}/data{seed}", n_train=args.n_train, n_val=args.n_val,
                                             seed=seed, **task_args)
    train, val = PromptDataset(train_path, tok, 16), PromptDataset(val_path, tok, 16)
    reward, val_prompts = RuleRewardWorker(str(path)), val.to_batch(range(len(val)), epoch="val")
    log = [f"seed {seed}: init {accuracy(model, tok, reward, val_prompts):.2f}"]

    warm = SFTDataset(f"{workdir}/data{seed}/warm_start.parquet", tok, 16, 4)
    opt, sampler = torch.optim.AdamW(model.parameters(), lr=args.lr), ResumableSampler(len(warm), 32, seed)
    for _ in range(args.sft_steps):
        b = warm.to_batch(sampler.next_indices())
        logits = model.train()(input_ids=b[INPUT_IDS], attention_mask=b[ATTENTION_MASK]).logits[:, :-1]
        nll = -torch.log_softmax(logits, -1).gather(-1, b[INPUT_IDS][:, 1:, None]).squeeze(-1)
        loss = (nll * b[LOSS_MASK][:, 1:]).sum() / b[LOSS_MASK][:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    log.append(f"warm {accuracy(model, tok, reward, val_prompts):.2f}")

    opt, sampler = torch.optim.AdamW(model.parameters(), lr=args.rl_lr), ResumableSampler(len(train), args.prompts, seed)
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        rollouts = generate(model.eval(), tok, train.to_batch(sampler.next_indices(), sampler.epoch), args.n, False, 4)
        scores = reward.score(rollouts)[TOKEN_LEVEL_SCORES].sum(1).view(-1, args.n)          # (P, n)
        adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).view(-1)
        with torch.no_grad():
            old = response_logprobs(model, rollouts)
        model.train()
        for group in torch.randperm(args.prompts).chunk(args.mini_batches):
            rows = (group[:, None] * args.n + torch.arange(args.n)).flatten()
            mb, mask = rollouts.select(rows), rollouts[RESPONSE_MASK][rows]
            ratio = torch.exp(response_logprobs(model, mb) - old[rows])
            a = adv[rows, None]
            pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
            for g in opt.param_groups:
                g["lr"] = args.rl_lr * min(1.0, step / 20)
            opt.zero_grad()
            ((pg * mask).sum() / mask.sum()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if step % 100 == 0:
            log.append(f"rl{step} {accuracy(model, tok, reward, val_prompts):.2f}")
    print(", ".join(log) + f" ({time.monotonic() - start:.0f}s of RL)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--n-train", type=int, default=80)
    parser.add_argument("--n-val", type=int, default=20)
    parser.add_argument("--max-operand", type=int, default=None)
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="warm-start learning rate")
    parser.add_argument("--rl-lr", type=float, default=5e-4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as workdir:
        for seed in args.seeds:
            run(seed, args, workdir)


if __name__ == "__main__":
    main()
