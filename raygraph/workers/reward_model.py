"""A reward-model worker: a one-label sequence classifier scores prompt + response.

The score is read at the last valid token of each sequence and placed on the last response
token of `token_level_scores`. The reward model may use a different tokenizer from the policy:
each row's valid tokens are decoded with the policy tokenizer (special tokens kept, so the chat
markup survives) and re-encoded with the reward model's. When both tokenizers have the same
vocabulary the ids are used as they are (no decode/encode round trip).

The score is computed from the base model's hidden state at the last column of LEFT-padded
inputs rather than through Hugging Face's pooled output, which finds "the last token" by
looking for the pad id and so scores the wrong token when pad == eos and a response ends in eos.
"""

from __future__ import annotations

import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, UID, Batch, response_attention
from raygraph.models.loading import load_reward_model, load_tokenizer
from raygraph.models.logprobs import position_ids_from_mask
from raygraph.rewards.batching import reward_batch
from raygraph.workers.distributed import default_device

__all__ = ["RewardModelWorker"]


class RewardModelWorker:
    """Scores rollouts with `AutoModelForSequenceClassification` (one label).

    Args:
        model_path: the reward model (directory or hub id), with its tokenizer.
        policy_tokenizer_path: the tokenizer that produced `prompt_ids`/`responses`
            (None: the reward model's own).
        dtype, attn_impl: see `raygraph.models.loading`.
        micro_batch_size: sequences per forward pass.
        device: default: the current CUDA device, else CPU.
        on_non_finite: "fail" | "zero", what a NaN/Inf score does (`raygraph.rewards.batching`).
    """

    def __init__(self, *, model_path: str, policy_tokenizer_path: str | None = None, dtype: str = "float32",
                 attn_impl: str = "auto", micro_batch_size: int = 16, device: str | None = None,
                 on_non_finite: str = "fail") -> None:
        self.device = default_device(device)
        self.model_path, self.on_non_finite = model_path, on_non_finite
        self.tokenizer = load_tokenizer(model_path)
        self.policy_tokenizer = load_tokenizer(policy_tokenizer_path) if policy_tokenizer_path else self.tokenizer
        self.model = load_reward_model(model_path, dtype=dtype, attn_impl=attn_impl,
                                       tokenizer=self.tokenizer).to(self.device)
        self.same_vocab = self.policy_tokenizer.get_vocab() == self.tokenizer.get_vocab()
        self.micro_batch_size = micro_batch_size

    def _sequences(self, batch: Batch) -> list[list[int]]:
        """Each row's prompt + response valid tokens, in reward-model ids."""
        seqs = [torch.cat([p[pm.bool()], r[rm.bool()]]).tolist() for p, pm, r, rm in zip(
            batch[PROMPT_IDS], batch[PROMPT_MASK], batch[RESPONSES], response_attention(batch))]
        if self.same_vocab:
            return seqs
        texts = self.policy_tokenizer.batch_decode(seqs, skip_special_tokens=False)
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def _score(self, seqs: list[list[int]]) -> torch.Tensor:
        """`(N,)` float32 scores of token sequences (left-padded so the last column is valid)."""
        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=self.device)
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=self.device)
        head = getattr(self.model, "score", None)
        if head is None:  # not a decoder-style classifier: fall back to HF's own pooling
            return self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        body = getattr(self.model, self.model.base_model_prefix)
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                      use_cache=False).last_hidden_state[:, -1]
        return head(hidden)[:, 0].float()

    def score(self, batch: Batch) -> Batch:
        """`Batch[token_level_scores (B, R)]`: the score on each row's last response token."""
        seqs = self._sequences(batch)
        scores = [self._score(seqs[i:i + self.micro_batch_size]).cpu()
                  for i in range(0, len(seqs), self.micro_batch_size)]
        return reward_batch(torch.cat(scores).tolist() if scores else [], {}, batch[RESPONSE_MASK],
                            source=f"reward model {self.model_path}", uids=list(batch[UID]) if UID in batch else None,
                            on_non_finite=self.on_non_finite)
