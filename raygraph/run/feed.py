"""What the driver feeds the DAG each step and how it reads the DAG's small outputs back.

The driver only ever holds prompts (it read them from parquet) and metric dictionaries; the
rollouts, scores and log-probs stay in the object store between actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raygraph.agents.tools import Toolbox
from raygraph.batch import EXTRA_PROMPTS, NEXT_PROMPTS, UID, Batch
from raygraph.data import PromptDataset, ResumableSampler, load_offline_dataset
from raygraph.data.sampler import MixedSampler
from raygraph.errors import BadData
from raygraph.models.loading import load_tokenizer
from raygraph.run.data_checks import check_data

__all__ = ["StepData", "merge_outputs", "prompt_template_kwargs"]


def merge_outputs(outputs: Any) -> dict[str, float]:
    """Flatten the DAG's outputs (dicts, or lists/tuples of dicts) into one metrics dict."""
    merged: dict[str, float] = {}
    if isinstance(outputs, dict):
        outputs = [outputs]
    for item in outputs:
        if isinstance(item, dict):
            merged.update(item)
        elif isinstance(item, (list, tuple)):
            merged.update(merge_outputs(item))
        else:
            raise TypeError(f"a workflow DAG must output metric dicts, got {type(item).__name__}")
    return merged


@dataclass
class StepData:
    """Training prompts with a resumable sampler, and the validation prompts as one batch."""

    train: Any
    sampler: Any
    val_prompts: Batch | None
    # the sampler's position after the step's batch and after each extra batch (see `settle`)
    _after_round: list = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, cfg, data_format: str = "rl") -> StepData:
        tokenizer_path = cfg.model.tokenizer_path or cfg.model.path
        tokenizer = load_tokenizer(tokenizer_path)
        d = cfg.data
        if d.apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise BadData(f"data.apply_chat_template is true but the tokenizer at {tokenizer_path} has no chat "
                             "template: set data.apply_chat_template=false (prompts are then the messages' text), "
                             "or point model.tokenizer_path at a tokenizer with one")

        template_kwargs = prompt_template_kwargs(cfg)

        def prompts(files):
            return PromptDataset(files, tokenizer, max_prompt_length=d.max_prompt_length,
                                 overlong=d.overlong_prompt, apply_chat_template=d.apply_chat_template,
                                 chat_template_kwargs=template_kwargs)

        if data_format == "rl":
            train = prompts(d.train_files)
        else:
            train = load_offline_dataset(data_format, d.train_files, tokenizer,
                                         max_prompt_length=d.max_prompt_length,
                                         max_response_length=cfg.rollout.max_new_tokens,
                                         apply_chat_template=d.apply_chat_template,
                                         chat_template_kwargs=d.chat_template_kwargs)
        val_set = prompts(d.val_files) if d.val_files else None
        check_data(cfg, train, val_set.rows if val_set is not None else (), tokenizer)  # every problem at once
        if d.train_weights is not None:   # the config checks: data.format rl, one weight per file
            sampler = MixedSampler(train.rows_per_file, d.train_weights, d.prompts_per_step, seed=cfg.trainer.seed,
                                   shuffle=d.shuffle)
        else:
            sampler = ResumableSampler(len(train), d.prompts_per_step, seed=cfg.trainer.seed, shuffle=d.shuffle)
        val = None
        if val_set is not None:
            n_val = min(len(val_set), d.val_prompts or len(val_set))
            val = val_set.to_batch(list(range(n_val)), epoch="val")
        return cls(train, sampler, val)

    def next_prompts(self, *, step: int, kl_coef: float, lookahead_shares: int = 0, extra_batches: int = 0) -> Batch:
        """The next training batch; per-step values for whole-batch steps travel in `meta`.

        Args:
            step, kl_coef: per-step values put in `meta`.
            extra_batches: k > 0 also attaches the k batches that follow in the data order
                (`meta[EXTRA_PROMPTS]`, e.g. DAPO's extra generation rounds; k is derived from the
                step graph, `GraphFacts.extra_prompt_batches`); `settle` then puts back those the
                step did not generate from.
            lookahead_shares: k > 0 (asynchronous pipelining over k rollout ranks) also attaches
                the NEXT step's prompts, split as the DAG splits a batch over k ranks
                (`Batch.chunk_by_group(k)`): `meta[NEXT_PROMPTS] = {uids of rank r's share of
                this batch: rank r's share of the next}`. The sampler stays where this batch left
                it, so the next call returns those same prompts and a checkpoint taken after this
                step resumes with the same data order.
        """
        batch = self._draw()
        batch.meta.update(step=step, kl_coef=kl_coef)
        self._after_round = [self.sampler.state_dict()]
        if extra_batches:
            extra = []
            for _ in range(extra_batches):
                extra.append(self._draw())
                self._after_round.append(self.sampler.state_dict())
            batch.meta[EXTRA_PROMPTS] = extra
        if lookahead_shares:
            position = self.sampler.state_dict()
            upcoming = self._draw()
            self.sampler.load_state_dict(position)
            batch.meta[NEXT_PROMPTS] = {tuple(now[UID]): ahead for now, ahead in
                                        zip(batch.chunk_by_group(lookahead_shares),
                                            upcoming.chunk_by_group(lookahead_shares))}
        return batch

    def settle(self, prompts: Batch, batches_used: int) -> list:
        """After a step: the uids of the prompts it generated from (its own, plus those of the
        extra batches it used: `batches_used` in all, `StepReport.prompt_batches`); the extra
        batches it did not use go back to the data order, so the next step (and a checkpoint)
        starts with them."""
        extra = prompts.meta.get(EXTRA_PROMPTS) or []
        if not extra:
            return list(prompts[UID])
        self.sampler.load_state_dict(self._after_round[batches_used - 1])
        return [uid for batch in [prompts, *extra[:batches_used - 1]] for uid in batch[UID]]

    def _draw(self) -> Batch:
        indices = self.sampler.next_indices()
        if isinstance(self.train, PromptDataset):  # uids must differ between epochs
            epoch = self.sampler.epochs if isinstance(self.sampler, MixedSampler) else self.sampler.epoch
            return self.train.to_batch(indices, epoch=epoch)
        return self.train.to_batch(indices)


def prompt_template_kwargs(cfg) -> dict:
    """The chat template's variables for prompts: `data.chat_template_kwargs`, plus the tools'
    schemas (`tools=`) when episodes may call tools, so the model is told about them."""
    kwargs = dict(cfg.data.chat_template_kwargs)
    agent = cfg.rollout.agent
    if agent is not None and agent.tools:
        kwargs["tools"] = Toolbox(agent.tools).schemas
    return kwargs
