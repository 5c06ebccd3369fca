"""The actor: log-probs of rollouts and the policy-gradient update, in plain PyTorch.

    worker = PolicyWorker(model_path=path, lr=1e-6)
    batch = batch.union(worker.logprobs(batch))           # + old_logprobs, entropy
    metrics = worker.update(batch.union(advantages))      # actor/* metrics
    rollout.load_weights(worker.weight_buckets(), version)  # streamed bucket by bucket

Precision: master weights and optimizer state are float32; `dtype` is the compute dtype
(FSDP2 mixed precision when sharded, autocast otherwise). Data parallel: when
`torch.distributed` is initialised with world size > 1 the model is sharded with FSDP2 and each
rank passes its own shard of the batch; losses are normalised by global token counts so that
N ranks x 1/N of the batch gives the gradient of 1 rank x the whole batch. The lr scheduler
advances once per optimizer step (`warmup_steps`, `total_steps` count optimizer steps; one
`update()` makes `ppo_epochs x ceil(shard / mini_batch_size)` of them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from raygraph.algos import kl, losses
from raygraph.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    ENTROPY,
    INPUT_IDS,
    LOSS_MASK,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    RESPONSE_ATTENTION,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_LOGPROBS,
    SEQUENCE_COLUMNS,
    Batch,
    pad_right,
)
from raygraph.errors import MissingColumn
from raygraph.models.loading import load_causal_lm, load_tokenizer, resolve_dtype
from raygraph.models.logprobs import forward_response, token_logprobs_of_sequence, use_packed
from raygraph.models.lora import LoraSpec
from raygraph.workers.adapter import PolicyAdapter
from raygraph.workers.distributed import all_reduce, dummy_row, lockstep, rank
from raygraph.workers.train_loop import MicroResult
from raygraph.workers.trained_model import TrainedModel
from raygraph.workers.weight_buckets import iter_weight_buckets

__all__ = ["INPUT_IDS", "ATTENTION_MASK", "LOSS_MASK", "PolicyWorker"]   # the first three: columns of an SFT batch

log = logging.getLogger(__name__)


class PolicyWorker:
    """The trainable policy of one data-parallel rank. Arguments are flat (see module docstring).

    Args mirror the config: optimiser (`lr`, `weight_decay`, `betas`, `warmup_steps`,
    `total_steps`, `lr_schedule` constant|cosine|linear, `min_lr_ratio`, `grad_clip`), the PPO
    loop (`ppo_epochs`; `mini_batch_size` rows per optimizer step on this rank, None = the
    whole shard; `micro_batch_size` rows per forward), the loss (`policy_loss` name from
    `raygraph.algos.losses`, `clip_low`, `clip_high`, `dual_clip`, `loss_agg`, `entropy_coef`,
    `kl_loss_coef` with estimator `kl_loss_kind`), and `temperature` (the sampler's).
    With `lora` (docs/lora.md) only adapters train, `ref_logprobs` is the base model's, and
    `weight_buckets` yields what `lora_sync` names ("adapter" | "merged", `workers.adapter`).
    """

    def __init__(self, *, model_path: str, dtype: str = "float32", attn_impl: str = "auto",
                 gradient_checkpointing: bool = False, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), warmup_steps: int = 0, total_steps: int | None = None,
                 lr_schedule: str = "constant", min_lr_ratio: float = 0.0, grad_clip: float | None = 1.0,
                 ppo_epochs: int = 1, mini_batch_size: int | None = None, micro_batch_size: int = 16,
                 max_tokens_per_micro_batch: int | None = None,
                 policy_loss: str = "ppo", clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float = 3.0,
                 loss_agg: str = "token-mean", entropy_coef: float = 0.0, kl_loss_coef: float = 0.0,
                 kl_loss_kind: str = "k3", temperature: float = 1.0, seed: int = 0,
                 lora: LoraSpec | None = None, lora_sync: str = "adapter", device: str | None = None) -> None:
        if loss_agg not in losses.AGG_MODES:
            raise ValueError(f"unknown loss_agg {loss_agg!r}; valid: {', '.join(losses.AGG_MODES)}")
        losses.policy_loss_fn(policy_loss)   # a registered name or file.py:fn; ValueError listing valid names
        kl.check(kl_loss_kind)   # a registered name or a file.py:fn reference
        torch.manual_seed(seed)
        self.tokenizer = load_tokenizer(model_path)
        model = load_causal_lm(model_path, dtype="float32", attn_impl=attn_impl,
                               gradient_checkpointing=gradient_checkpointing)
        self.adapter = None if lora is None else PolicyAdapter(lora, sync=lora_sync, dtype=dtype)
        if self.adapter is not None:
            model = self.adapter.wrap(model)
        self.trained = TrainedModel(
            model, dtype=dtype, device=device, lr=lr, weight_decay=weight_decay, betas=betas,
            warmup_steps=warmup_steps, total_steps=total_steps, lr_schedule=lr_schedule,
            min_lr_ratio=min_lr_ratio, grad_clip=grad_clip, ppo_epochs=ppo_epochs,
            mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.model, self.device = self.trained.model, self.trained.device
        self.packed = use_packed(self.model, None)
        self.ppo_epochs, self.mini_batch_size, self.micro_batch_size = ppo_epochs, mini_batch_size, micro_batch_size
        self.policy_loss, self.loss_agg = policy_loss, loss_agg
        self.clip_low, self.clip_high, self.dual_clip = clip_low, clip_high, dual_clip
        self.entropy_coef, self.kl_loss_coef, self.kl_loss_kind = entropy_coef, kl_loss_coef, kl_loss_kind
        self._first_step_rows = 0       # rows of this update still at the weights that sampled them
        self._rollout_gap = torch.zeros(3)   # max, sum and count of |log-prob - rollout log-prob| there
        self.temperature = temperature

    # ------------------------------------------------------------------------------ inference
    @torch.no_grad()
    def logprobs(self, batch: Batch) -> Batch:
        """`Batch[old_logprobs (B, R), entropy (B, R)]` under the current weights (float32, CPU)."""
        self.model.eval()
        columns = batch.select_columns(SEQUENCE_COLUMNS)
        logprobs, entropy = [], []
        micros = columns.micro_batches(self.micro_batch_size, self.trained.max_tokens_per_micro_batch)
        width = columns[RESPONSES].shape[1]
        for micro, is_dummy in lockstep(micros, lambda: dummy_row(columns)):
            with self.trained.compute():
                lp, ent = forward_response(self.model, micro, temperature=self.temperature, with_entropy=True,
                                           packed=self.packed)
            if not is_dummy:
                logprobs.append(pad_right(lp.float().cpu(), width))
                entropy.append(pad_right(ent.float().cpu(), width))
        if not logprobs:   # no rows here (an empty refill round, or a rank left without a share)
            return Batch({OLD_LOGPROBS: torch.zeros(0, width), ENTROPY: torch.zeros(0, width)})
        return Batch({OLD_LOGPROBS: torch.cat(logprobs), ENTROPY: torch.cat(entropy)})

    @torch.no_grad()
    def ref_logprobs(self, batch: Batch) -> Batch:
        """`Batch[ref_logprobs (B, R)]`: the base model's log-probs (adapter disabled), the
        reference of a LoRA policy without a second model. Needs `lora`."""
        if self.adapter is None:
            raise RuntimeError("PolicyWorker.ref_logprobs needs LoRA (model.lora): without adapters the "
                               "policy is not the reference; run a ReferenceWorker")
        with self.adapter.reference(self.model):
            return Batch({REF_LOGPROBS: self.logprobs(batch)[OLD_LOGPROBS]})

    # ------------------------------------------------------------------------------ training
    def _ppo_loss(self, micro: Batch) -> MicroResult:
        mask = micro[RESPONSE_MASK].to(self.device)
        with self.trained.compute():
            logprobs, entropy = forward_response(
                self.model, micro, temperature=self.temperature, with_entropy=True,
                entropy_grad=self.entropy_coef != 0.0, packed=self.packed)
        # Without old_logprobs the update is one on-policy optimizer step (checked in `update`):
        # the policy before it is the policy of this forward pass, so pi_old = pi exactly.
        old = micro[OLD_LOGPROBS].to(self.device) if OLD_LOGPROBS in micro else logprobs.detach()
        self._track_rollout_gap(micro, logprobs, mask)
        pg_loss, stats = losses.policy_loss(
            self.policy_loss, logprobs=logprobs, old_logprobs=old,
            advantages=micro[ADVANTAGES].to(self.device), response_mask=mask, clip_low=self.clip_low,
            clip_high=self.clip_high, dual_clip=self.dual_clip, agg=self.loss_agg)
        entropy_agg = losses.aggregate(entropy, mask, self.loss_agg)
        loss = pg_loss - self.entropy_coef * entropy_agg if self.entropy_coef else pg_loss
        terms = {"pg_loss": pg_loss.detach()}
        if self.kl_loss_coef:
            kl_mat = kl.estimate(logprobs, micro[REF_LOGPROBS].to(self.device), self.kl_loss_kind)
            kl_loss = losses.aggregate(kl_mat, mask, self.loss_agg)
            loss = loss + self.kl_loss_coef * kl_loss
            terms["kl_loss"] = kl_loss.detach()
        token_mean = entropy.detach().sum() / mask.sum().clamp(min=1)
        stats = dict(stats) | {"entropy": token_mean}   # every stat the loss reports becomes actor/<key>
        return MicroResult(loss=loss, loss_terms=terms, token_stats=stats)

    def _track_rollout_gap(self, micro: Batch, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """Largest and summed gap between the rollout engine's log-probs and ours, and the tokens
        counted, on the first optimizer step's rows (where the weights are those that sampled)."""
        if self._first_step_rows <= 0 or ROLLOUT_LOGPROBS not in micro:
            return
        gap = (logprobs.detach().float() - micro[ROLLOUT_LOGPROBS].to(self.device)).abs() * mask
        if gap.numel():   # kept on the device: read once after the update, no sync per micro-batch
            running = self._rollout_gap.to(gap.device)
            self._rollout_gap = torch.stack([torch.maximum(running[0], gap.max()), running[1] + gap.sum(),
                                             running[2] + mask.sum()])
        self._first_step_rows -= len(micro)

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches on this rank's shard.

        Needs `prompt_ids`, `prompt_mask`, `responses`, `response_mask`, `advantages` (and
        `ref_logprobs` when `kl_loss_coef` > 0), and `old_logprobs` unless the update is ONE
        optimizer step (one epoch, one mini-batch): then the policy before the step is the one
        being differentiated, and its detached log-probs are `old_logprobs` (no extra pass).
        With `rollout_logprobs` in the batch it also reports `rollout/logprob_diff_max` and
        `rollout/logprob_diff_mean`, the largest and the mean per-token gap between the rollout
        engine's and the policy's log-probs at the weights that sampled (on the first optimizer
        step's rows).

        Returns:
            `actor/pg_loss`, `actor/grad_norm`, `actor/clipfrac`, `actor/clipfrac_lower`,
            `actor/approx_kl` (a user loss: the stats it returns), `actor/entropy`,
            `actor/kl_loss`, `actor/skipped_steps`, `actor/empty_updates` (1: no rank had a row,
            no optimizer step, see `train_loop.run_minibatches`): means over the optimizer
            steps of this call, global over ranks (identical on every rank); `actor/lr`: the
            lr of the last step.
        """
        needed = [*SEQUENCE_COLUMNS, ADVANTAGES]
        first_step = len(batch) if self.mini_batch_size is None else min(self.mini_batch_size, len(batch))
        if OLD_LOGPROBS in batch:
            needed.append(OLD_LOGPROBS)
        elif self.ppo_epochs > 1 or first_step < len(batch):
            raise MissingColumn(f"PolicyWorker.update needs {OLD_LOGPROBS!r}: this update takes "
                           f"{self.ppo_epochs} epoch(s) x {-(-len(batch) // first_step)} mini-batch(es), and "
                           "after the first optimizer step the policy is no longer the one that sampled; "
                           "bind policy.logprobs (actor.old_logprobs=recompute) or use the rollout's "
                           "(actor.old_logprobs=rollout)")
        if self.kl_loss_coef:
            needed.append(REF_LOGPROBS)
        if ROLLOUT_LOGPROBS in batch:
            needed.append(ROLLOUT_LOGPROBS)
        missing = [c for c in needed if c not in batch and c != RESPONSE_ATTENTION]
        if missing:
            raise MissingColumn(f"PolicyWorker.update needs columns {missing}; the batch has {batch.columns()}")
        self._first_step_rows, self._rollout_gap = first_step, torch.zeros(3)
        metrics = self._run(batch.select_columns(needed), self._ppo_loss, RESPONSE_MASK, self.ppo_epochs,
                            self.loss_agg, defaults={"kl_loss": 0.0})
        if ROLLOUT_LOGPROBS in batch:
            gap = self._rollout_gap.to("cpu", torch.float64)
            largest, (total, tokens) = all_reduce(gap[:1], op="max"), all_reduce(gap[1:], op="sum")
            metrics["rollout/logprob_diff_max"] = float(largest)
            metrics["rollout/logprob_diff_mean"] = float(total / tokens.clamp(min=1))
        return metrics

    def _run(self, batch: Batch, loss_fn, mask_key: str, epochs: int, agg: str,
             defaults: dict[str, float], stage_lr: float | None = None) -> dict[str, float]:
        metrics = self.trained.train(batch, loss_fn, mask_key=mask_key, loss_agg=agg, epochs=epochs,
                                     stage_lr=stage_lr)
        sync = self.adapter.metrics() if self.adapter is not None else {}
        if metrics.get("empty_updates"):
            log.warning("policy: no rows to train on any rank this step (all filtered out): no optimizer step")
        if metrics["skipped_steps"]:
            log.warning("policy: skipped %d optimizer step(s) with a non-finite loss or gradient norm",
                        metrics["skipped_steps"])
        return {f"actor/{k}": v for k, v in (defaults | metrics).items()} | sync

    def _sft_loss(self, micro: Batch) -> MicroResult:
        input_ids, attention_mask = micro[INPUT_IDS].to(self.device), micro[ATTENTION_MASK].to(self.device)
        mask = micro[_SFT_TARGETS].to(self.device)  # (B, T - 1)
        with self.trained.compute():
            logprobs = token_logprobs_of_sequence(self.model, input_ids, attention_mask)
        nll = losses.aggregate(-logprobs, mask, "token-mean")
        return MicroResult(loss=nll, loss_terms={"sft_loss": nll.detach()}, token_stats={})

    def sft_update(self, batch: Batch, *, lr: float | None = None) -> dict[str, float]:
        """One epoch of supervised fine-tuning: token-mean NLL of the `loss_mask` tokens.

        Needs `input_ids`, `attention_mask`, `loss_mask` (B, T); `loss_mask[:, t]` = 1 makes
        token t a target. With `lr`, the step uses a separate constant-lr AdamW (a warm-start
        stage before RL, `TrainedModel.train(stage_lr=)`) and leaves the policy's own optimizer
        and schedule untouched.
        Returns `actor/sft_loss`, `actor/grad_norm`, `actor/lr`, `actor/skipped_steps`.
        """
        batch = batch.select_columns([INPUT_IDS, ATTENTION_MASK]).with_columns(
            **{_SFT_TARGETS: batch[LOSS_MASK][:, 1:]})
        return self._run(batch, self._sft_loss, _SFT_TARGETS, 1, "token-mean", defaults={}, stage_lr=lr)

    def _dpo_loss(self, micro: Batch, beta: float, kind: str) -> MicroResult:
        mask = micro[RESPONSE_MASK].to(self.device)
        with self.trained.compute():
            logprobs, _ = forward_response(self.model, micro, packed=self.packed)
        seq = logprobs.sum(-1)  # (2b,): rows alternate chosen, rejected
        ref = (micro[REF_LOGPROBS].to(self.device) * mask).sum(-1)
        loss, stats = losses.dpo_loss(chosen_logps=seq[0::2], rejected_logps=seq[1::2], ref_chosen_logps=ref[0::2],
                                      ref_rejected_logps=ref[1::2], beta=beta, kind=kind)
        return MicroResult(loss=loss, loss_terms={"dpo_loss": loss.detach(), **stats}, token_stats={})

    def dpo_update(self, batch: Batch, *, beta: float = 0.1, kind: str = "sigmoid") -> dict[str, float]:
        """One epoch of DPO on preference pairs in the rollout layout.

        Rows alternate chosen, rejected (pair i = rows 2i, 2i + 1) with `prompt_ids`,
        `prompt_mask`, `responses`, `response_mask` and `ref_logprobs` (from the reference
        worker, at temperature 1: DPO compares plain log pi). Pairs are averaged
        (`mini_batch_size`/`micro_batch_size` must be even).
        Returns `actor/dpo_loss`, `actor/rewards/*`, `actor/grad_norm`, `actor/lr`.
        """
        if len(batch) % 2 or (self.micro_batch_size % 2) or (self.mini_batch_size or 0) % 2:
            raise ValueError("dpo_update needs an even number of rows and even mini/micro batch sizes")
        pairs = batch.with_columns(**{_DPO_PAIRS: torch.ones(len(batch), 1, dtype=torch.long)})
        return self._run(pairs, lambda m: self._dpo_loss(m, beta, kind), _DPO_PAIRS, 1, "seq-mean-token-sum",
                         defaults={})

    # ------------------------------------------------------------------------------ weights, checkpoints
    def weight_buckets(self, bucket_bytes: int = 64 << 20,
                       dtype: str | torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in HF state-dict names, one bucket of ~`bucket_bytes` at a time.

        Tied weights appear once (e.g. `model.embed_tokens.weight`, not `lm_head.weight`).
        Under FSDP2 every rank must drain this iterator (each tensor is all-gathered when
        reached); all ranks receive the tensors, only rank 0 needs to keep or send them.
        `dtype` casts floating tensors (e.g. to the rollout's bf16) before bucketing.

        No copy is made of an unsharded model's weights (a weight sync packs or loads each
        bucket at once): the tensors are the live parameters, so copy them (`.clone()`) to
        keep them across an `update`.
        """
        dtype = None if dtype is None else resolve_dtype(dtype)
        if self.adapter is not None:   # LoRA: the adapter only, or merged weights (`lora_sync`)
            return self.adapter.weight_buckets(self.model, bucket_bytes, dtype)
        return iter_weight_buckets(self.model, bucket_bytes, dtype, copy=False)

    def save_checkpoint(self, path: str | Path) -> None:
        """Model, optimizer, scheduler and RNG state (all ranks call; sharded under FSDP2)."""
        self.trained.save(path)

    def load_checkpoint(self, path: str | Path) -> None:
        self.trained.load(path)

    def save_pretrained(self, path: str | Path) -> None:
        """HF `save_pretrained` format + tokenizer, written by rank 0 (all ranks must call).
        With LoRA: the merged model, and the adapter in PEFT format at `<path>_adapter`."""
        if self.adapter is not None:
            return self.adapter.save_pretrained(self.model, path, self.tokenizer)
        keep = rank() == 0  # other ranks only take part in the all-gathers
        state = {name: t.cpu() for bucket in self.weight_buckets() for name, t in bucket if keep}
        if keep:
            self.model.save_pretrained(str(path), state_dict=state)
            self.tokenizer.save_pretrained(str(path))


_SFT_TARGETS = "_sft_targets"  # loss_mask shifted to align with the (B, T - 1) next-token log-probs
_DPO_PAIRS = "_dpo_pairs"      # one "token" per row, so seq-mean weights count rows (pairs x 2)
