"""Fixtures for reward tests: the tiny tokenizer saved to disk, and rollout-like batches."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import DATA_SOURCE, GROUND_TRUTH, PROMPT_TEXT, RESPONSE_MASK, RESPONSES, Batch
from raygraph.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("char_tokenizer")
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def response_batch(tokenizer, texts, truths, sources, eos=True) -> Batch:
    """Right-padded responses tokenized from `texts` (+ eos when asked), as a rollout makes them."""
    seqs = [tokenizer(t, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if eos and t else [])
            for t in texts]
    width = max(len(s) for s in seqs) + 1
    responses = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        responses[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
        mask[i, :len(s)] = 1
    return Batch({RESPONSES: responses, RESPONSE_MASK: mask},
                 {GROUND_TRUTH: truths, DATA_SOURCE: sources,
                  PROMPT_TEXT: [f"<|user|>q{i}<|end|><|assistant|>" for i in range(len(texts))]})


@pytest.fixture
def make_response_batch():
    return response_batch
