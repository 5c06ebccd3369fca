"""Optional supervised warm start before RL (`trainer.warm_start`).

A few SFT steps on prompt/response pairs, with their own constant learning rate and optimizer
(the RL optimizer and schedule start untouched afterwards), then one weight sync so that the
rollout engine samples from the warm-started policy. The steps are the `sft` workflow's
(`PolicyWorker.sft_update`, same loss and loop) with `lr=`, which steps a separate AdamW
(`TrainedModel.train(stage_lr=)`): the policy's own optimizer has the RL lr, weight decay, betas
and schedule, and its moments and schedule position must be fresh at step 1. The driver reads the SFT rows (it owns the
data files) and hands each policy rank its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from raygraph.batch import Batch
from raygraph.data import ResumableSampler, load_offline_dataset
from raygraph.models.loading import load_tokenizer

__all__ = ["run_warm_start", "warm_start_batches"]

log = logging.getLogger("raygraph")


def run_warm_start(cfg, roles, stopping: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """Run `trainer.warm_start.steps` SFT steps on the policy, then sync weights to the rollout.
    A stop signal (`stopping()`) ends it at the next SFT step: nothing of it is checkpointed, and
    a resumed run, having no step, warm-starts again.

    Returns the last step's metrics (`actor/sft_loss`, ...) prefixed `warm_start/`.
    """
    ws = cfg.trainer.warm_start
    metrics: dict[str, float] = {}
    for step, batch in enumerate(warm_start_batches(cfg), start=1):
        if stopping():
            print(f"[raygraph] warm start stopped before step {step}/{ws.steps}: stop requested", flush=True)
            return {}
        metrics = roles.policy.call_sharded("sft_update", batch, lr=ws.lr)[0]
        if step == 1 or step == ws.steps or step % 25 == 0:
            print(f"[raygraph] warm start {step}/{ws.steps} sft_loss={metrics['actor/sft_loss']:.4f}",
                  flush=True)
    roles.weights.sync_now()
    return {f"warm_start/{k.split('/', 1)[1]}": v for k, v in metrics.items()}


def warm_start_batches(cfg) -> Iterator[Batch]:
    """The `trainer.warm_start.steps` SFT batches, in order (seeded by `trainer.seed`)."""
    ws = cfg.trainer.warm_start
    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    dataset = load_offline_dataset("sft", ws.files or cfg.data.train_files, tokenizer,
                                   max_prompt_length=cfg.data.max_prompt_length,
                                   max_response_length=cfg.rollout.max_new_tokens,
                                   apply_chat_template=cfg.data.apply_chat_template,
                                   chat_template_kwargs=cfg.data.chat_template_kwargs)
    sampler = ResumableSampler(len(dataset), ws.batch_size, seed=cfg.trainer.seed)
    for _ in range(ws.steps):
        yield dataset.to_batch(sampler.next_indices())
