"""Advantage estimators: hand-derived values, naive-loop references, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from raygraph.algos import advantages

OUTCOME = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _all_inputs(rewards, mask):
    """Every optional input, so any estimator can run on (rewards, mask)."""
    batch = rewards.shape[0]
    return dict(
        token_rewards=rewards,
        response_mask=mask,
        group_ids=[i // 2 for i in range(batch)],
        values=torch.linspace(-1, 1, rewards.numel()).reshape(rewards.shape),
        reward_baselines=torch.full((batch,), 0.25),
    )


def _outcome_rewards(scores, mask):
    """Put each row's score on its last valid token, as a rule reward does."""
    rewards = torch.zeros(mask.shape)
    for i, row in enumerate(mask):
        valid = row.nonzero()
        if len(valid):
            rewards[i, valid[-1]] = scores[i]
    return rewards


# --------------------------------------------------------------------------- hand-computed values


def test_grpo_hand_values():
    # group "a": scores 1, 0 -> mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70711
    #   A = +-0.5 / (0.70711 + 1e-6) = +-0.70711
    # group "b": a single member with score 2 -> mean 0, std 1 -> A = 2 / (1 + 1e-6)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = _outcome_rewards([1.0, 0.0, 2.0], mask)
    adv, ret = advantages.compute("grpo", token_rewards=rewards, response_mask=mask, group_ids=["a", "a", "b"])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[a, a, 0.0], [-a, -a, -a], [2 / (1 + 1e-6), 0.0, 0.0]])
    assert_close(adv, expected)
    assert ret is adv


def test_dr_grpo_hand_values():
    # same groups as above without the std division: +-0.5 and the singleton keeps 2 - 0 = 2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = _outcome_rewards([1.0, 0.0, 2.0], mask)
    adv, _ = advantages.compute("dr_grpo", token_rewards=rewards, response_mask=mask, group_ids=["a", "a", "b"])
    assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [2.0, 0.0, 0.0]]))


def test_rloo_hand_values():
    # group of 3 with scores 1, 0, 0: leave-one-out baselines 0, 0.5, 0.5
    #   A = [1 - 0, 0 - 0.5, 0 - 0.5]; formula: s*3/2 - (1/3)*3/2 = [1.5 - 0.5, -0.5, -0.5]
    # singleton with score 3 is unchanged
    mask = torch.ones(4, 2)
    rewards = _outcome_rewards([1.0, 0.0, 0.0, 3.0], mask)
    adv, _ = advantages.compute("rloo", token_rewards=rewards, response_mask=mask, group_ids=[7, 7, 7, 8])
    assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 3.0]))
    assert_close(adv[:, 1], adv[:, 0])


def test_gae_hand_values():
    # one row, gamma = lam = 0.5, rewards [0, 0, 1], values [0.5, 0.2, 0.4]:
    #   t=2: delta = 1 + 0.5*0   - 0.4 =  0.6 ; A2 = 0.6
    #   t=1: delta = 0 + 0.5*0.4 - 0.2 =  0.0 ; A1 = 0.0  + 0.25*0.6  = 0.15
    #   t=0: delta = 0 + 0.5*0.2 - 0.5 = -0.4 ; A0 = -0.4 + 0.25*0.15 = -0.3625
    # returns = A + V = [0.1375, 0.35, 1.0]
    # whitening: mean(A) = 0.129167, unbiased var = 0.231927 -> (A - mean) / sqrt(var + 1e-8)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    adv, ret = advantages.compute(
        "gae", token_rewards=rewards, response_mask=torch.ones(1, 3), values=values, gamma=0.5, lam=0.5
    )
    assert_close(ret, torch.tensor([[0.1375, 0.35, 1.0]]))
    raw = [-0.3625, 0.15, 0.6]
    mean = sum(raw) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 2 + 1e-8)
    assert_close(adv, torch.tensor([[(a - mean) / std for a in raw]]))
    assert_close(adv, torch.tensor([[-1.020928, 0.043260, 0.977668]]))


def test_gae_masked_token_carries_value_and_advantage_through():
    # mask [1, 0, 1]: the middle (e.g. tool-output) token is skipped; its reward 5 and value 9
    # are ignored. gamma = lam = 0.5:
    #   t=2: A2 = 1 - 0.4 = 0.6, next value 0.4; t=1 masked: carry A = 0.6, next value 0.4
    #   t=0: delta = 0 + 0.5*0.4 - 0.5 = -0.3 ; A0 = -0.3 + 0.25*0.6 = -0.15
    # returns = [-0.15 + 0.5, 0 (masked), 0.6 + 0.4]
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.4]])
    _, ret = advantages.compute(
        "gae", token_rewards=rewards, response_mask=torch.tensor([[1, 0, 1]]), values=values, gamma=0.5, lam=0.5
    )
    assert_close(ret, torch.tensor([[0.35, 0.0, 1.0]]))


def test_reinforce_pp_hand_values():
    # gamma 0.5, row 0 rewards [0, 0, 1] -> G = [0.25, 0.5, 1]; row 1 [0, 2, pad] -> G = [1, 2]
    # valid G: [0.25, 0.5, 1, 1, 2]: mean 0.95, unbiased var = (0.49+0.2025+0.0025+0.0025+1.1025)/4
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = advantages.compute("reinforce_pp", token_rewards=rewards, response_mask=mask, gamma=0.5)
    assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    std = math.sqrt(1.8 / 4 + 1e-8)
    expected = torch.tensor([[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]]) / std
    expected[1, 2] = 0.0
    assert_close(adv, expected)


def test_reinforce_pp_baseline_hand_values():
    # group scores 1, 0 -> centred 0.5, -0.5; broadcast over valid tokens: [0.5, 0.5, -0.5]
    # batch mean 1/6, deviations [1/3, 1/3, -2/3], unbiased var (1/9+1/9+4/9)/2 = 1/3
    # whitened: [1/3, 1/3, -2/3] / sqrt(1/3) = [0.57735, 0.57735, -1.1547]
    mask = torch.tensor([[1, 1], [1, 0]])
    rewards = _outcome_rewards([1.0, 0.0], mask)
    adv, ret = advantages.compute("reinforce_pp_baseline", token_rewards=rewards, response_mask=mask, group_ids=[0, 0])
    s = math.sqrt(1 / 3 + 1e-8)
    assert_close(adv, torch.tensor([[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0.0]]))
    assert ret is adv


def test_remax_hand_values():
    # rewards [0, 1, 0.5] -> return-to-go (gamma 1) [1.5, 1.5, 0.5]; greedy baseline 1
    # A = [0.5, 0.5, -0.5]; returns are the return-to-go
    adv, ret = advantages.compute(
        "remax",
        token_rewards=torch.tensor([[0.0, 1.0, 0.5]]),
        response_mask=torch.ones(1, 3),
        reward_baselines=torch.tensor([1.0]),
    )
    assert_close(adv, torch.tensor([[0.5, 0.5, -0.5]]))
    assert_close(ret, torch.tensor([[1.5, 1.5, 0.5]]))


# --------------------------------------------------------------------------- naive references


def _random_batch(seed, batch=12, length=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    mask[0, 2] = 0  # an interior hole (a multi-turn observation token)
    rewards = torch.randn(batch, length, generator=gen) * mask
    values = torch.randn(batch, length, generator=gen)
    groups = torch.randint(0, 4, (batch,), generator=gen)
    return rewards, mask, values, groups


def _naive_whiten(x, mask):
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return (x - mean) / math.sqrt(var + 1e-8)


def _naive_gae(rewards, values, mask, gamma, lam):
    """Standard GAE on each row's valid tokens only, scattered back."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t]]
        last, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            next_v = float(values[i, t])
            adv[i, t] = last
    return adv


@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_naive_loop(seed):
    rewards, mask, values, _ = _random_batch(seed)
    adv, ret = advantages.compute(
        "gae", token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8
    )
    raw = _naive_gae(rewards, values, mask, 0.9, 0.8)
    assert_close(ret, (raw + values) * mask)
    assert_close(adv, _naive_whiten(raw, mask) * mask)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_matches_naive_loop(seed):
    rewards, mask, _, _ = _random_batch(seed)
    adv, ret = advantages.compute("reinforce_pp", token_rewards=rewards, response_mask=mask, gamma=0.9)
    expected = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed([t for t in range(rewards.shape[1]) if mask[i, t]]):
            running = float(rewards[i, t]) + 0.9 * running
            expected[i, t] = running
    assert_close(ret, expected)
    assert_close(adv, _naive_whiten(expected, mask) * mask)


def _naive_group_advantages(scores, groups, name, eps=1e-6):
    out = []
    for i, g in enumerate(groups):
        members = [float(scores[j]) for j in range(len(groups)) if groups[j] == g]
        n = len(members)
        mean = sum(members) / n if n > 1 else 0.0
        std = float(torch.tensor(members).std()) if n > 1 else 1.0  # torch.std is unbiased
        s = float(scores[i])
        if name == "grpo":
            out.append((s - mean) / (std + eps))
        elif name in ("dr_grpo", "reinforce_pp_baseline"):
            out.append(s - mean)
        else:  # rloo: mean of the others
            out.append(s - (sum(members) - s) / (n - 1) if n > 1 else s)
    return torch.tensor(out)


@pytest.mark.parametrize("name", OUTCOME)
@pytest.mark.parametrize("seed", [0, 1])
def test_group_estimators_match_naive_loop(name, seed):
    rewards, mask, _, groups = _random_batch(seed)
    adv, ret = advantages.compute(name, token_rewards=rewards, response_mask=mask, group_ids=groups)
    expected = _naive_group_advantages(rewards.sum(-1), groups.tolist(), name)[:, None] * mask
    if name == "reinforce_pp_baseline":
        expected = _naive_whiten(expected, mask) * mask
    assert_close(adv, expected)
    assert_close(ret, adv)


# --------------------------------------------------------------------------- edge cases and contract


@pytest.mark.parametrize("name", advantages.names())
def test_outputs_zero_outside_mask_float32_and_finite(name):
    rewards, mask, _, _ = _random_batch(3)
    mask[1] = 0  # a fully masked row
    adv, ret = advantages.compute(name, **_all_inputs(rewards.bfloat16(), mask.bool()))
    for out in (adv, ret):
        assert out.dtype == torch.float32 and out.shape == rewards.shape
        assert torch.isfinite(out).all()
        assert (out[mask == 0] == 0).all()
        assert not out.requires_grad


@pytest.mark.parametrize("name", advantages.names())
def test_bf16_inputs_match_float32(name):
    rewards, mask, _, _ = _random_batch(4)
    rewards = rewards.bfloat16().float()  # values exactly representable in bf16
    inputs = _all_inputs(rewards, mask)
    inputs["values"] = inputs["values"].bfloat16().float()
    expected = advantages.compute(name, **inputs)
    inputs.update(token_rewards=rewards.bfloat16(), values=inputs["values"].bfloat16())
    for got, want in zip(advantages.compute(name, **inputs), expected):
        assert got.dtype == torch.float32
        assert_close(got, want)


@pytest.mark.parametrize("name", advantages.names())
def test_mask_dtypes_agree(name):
    rewards, mask, _, _ = _random_batch(5)
    results = [advantages.compute(name, **_all_inputs(rewards, m)) for m in (mask.bool(), mask.long(), mask.float())]
    for adv, ret in results[1:]:
        assert_close(adv, results[0][0])
        assert_close(ret, results[0][1])


@pytest.mark.parametrize("name", ["gae", "reinforce_pp", "reinforce_pp_baseline"])
def test_single_valid_token_in_batch(name):
    # one valid token: its whitened advantage is (x - x) * rsqrt(0 + 1e-8) = 0, never NaN
    mask = torch.zeros(2, 3, dtype=torch.long)
    mask[0, 1] = 1
    rewards = torch.zeros(2, 3)
    rewards[0, 1] = 1.0
    adv, ret = advantages.compute(name, **_all_inputs(rewards, mask))
    assert torch.isfinite(adv).all() and (adv == 0).all()
    assert torch.isfinite(ret).all()


def test_zero_variance_group_gives_zero_advantage():
    mask = torch.ones(3, 2)
    rewards = _outcome_rewards([1.0, 1.0, 1.0], mask)
    for name in OUTCOME:
        adv, _ = advantages.compute(name, token_rewards=rewards, response_mask=mask, group_ids=["g"] * 3)
        assert (adv == 0).all(), name


def test_singleton_groups():
    # every row alone: grpo/dr_grpo/rloo pass the score through unchanged (mean 0, std 1)
    mask = torch.ones(3, 2)
    scores = torch.tensor([0.5, -1.0, 2.0])
    rewards = _outcome_rewards(scores, mask)
    for name in ("grpo", "dr_grpo", "rloo"):
        adv, _ = advantages.compute(name, token_rewards=rewards, response_mask=mask, group_ids=[1, 2, 3])
        assert_close(adv[:, 0], scores / (1 + 1e-6) if name == "grpo" else scores)


@pytest.mark.parametrize(
    "group_ids",
    [["x", "x", "y", "y"], np.array(["x", "x", "y", "y"], dtype=object), torch.tensor([5, 5, 9, 9]), (0, 0, 1, 1)],
)
def test_group_id_containers(group_ids):
    mask = torch.ones(4, 2)
    rewards = _outcome_rewards([1.0, 0.0, 3.0, 1.0], mask)
    adv, _ = advantages.compute("dr_grpo", token_rewards=rewards, response_mask=mask, group_ids=group_ids)
    assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 1.0, -1.0]))


@pytest.mark.parametrize(
    ("name", "missing"),
    [("gae", "values"), ("grpo", "group_ids"), ("dr_grpo", "group_ids"), ("rloo", "group_ids"),
     ("reinforce_pp_baseline", "group_ids"), ("remax", "reward_baselines")],
)
def test_missing_input_is_named(name, missing):
    inputs = _all_inputs(torch.zeros(2, 3), torch.ones(2, 3))
    inputs[missing] = None
    with pytest.raises(ValueError, match=missing):
        advantages.compute(name, **inputs)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: dr_grpo, gae, grpo"):
        advantages.compute("gpro", token_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))


def test_shape_errors():
    with pytest.raises(ValueError, match="must both be"):
        advantages.compute("reinforce_pp", token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="group_ids has 3 entries"):
        advantages.compute("grpo", token_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), group_ids=[0, 0, 1])
