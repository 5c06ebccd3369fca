"""Fixtures for model-level tests: a random prompt/response batch in the rollout layout."""

from __future__ import annotations

import pytest
import torch

from raygraph.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, RESPONSES, Batch

FIRST_CHAR_ID, VOCAB = 6, 93  # ids of the tiny tokenizer's ordinary characters


def random_rollout_batch(rows: int, prompt_len: int = 7, response_len: int = 6, seed: int = 0,
                         pad_id: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths (>= 1) and tokens."""
    gen = torch.Generator().manual_seed(seed)
    p_len = torch.randint(1, prompt_len + 1, (rows,), generator=gen)
    r_len = torch.randint(1, response_len + 1, (rows,), generator=gen)
    cols_p, cols_r = torch.arange(prompt_len), torch.arange(response_len)
    prompt_mask = (cols_p >= prompt_len - p_len[:, None]).long()
    response_mask = (cols_r < r_len[:, None]).long()
    prompt_ids = torch.randint(FIRST_CHAR_ID, VOCAB, (rows, prompt_len), generator=gen)
    responses = torch.randint(FIRST_CHAR_ID, VOCAB, (rows, response_len), generator=gen)
    return Batch({PROMPT_IDS: prompt_ids.masked_fill(prompt_mask == 0, pad_id), PROMPT_MASK: prompt_mask,
                  RESPONSES: responses.masked_fill(response_mask == 0, pad_id), RESPONSE_MASK: response_mask})


@pytest.fixture
def rollout_batch():
    return random_rollout_batch


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The tiny model's ops take microseconds; with 2 OpenMP threads on a busy 2-core machine
    each op waits ~10 ms for the other thread. One thread is faster here and deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
