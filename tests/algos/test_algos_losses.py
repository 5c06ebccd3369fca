"""Policy losses, value loss and aggregation: hand-derived values, naive references, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from raygraph.algos import losses

# --------------------------------------------------------------------------- aggregate

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 valid tokens
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum", 3.5),  # rows sum to 3 and 4; the empty row is excluded
        ("seq-mean-token-mean", 2.75),  # row means 1.5 and 4 -> 2.75
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / T, T = 3
    ],
)
def test_aggregate_hand_values(mode, expected):
    assert_close(losses.aggregate(LOSS, MASK, mode), torch.tensor(expected))


def _naive_aggregate(loss, mask, mode):
    rows = [[float(v) for v, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    tokens = [v for row in rows for v in row]
    nonempty = [row for row in rows if row]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "token-sum":
        return sum(tokens)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    seq_mean = sum(sum(r) for r in nonempty) / len(nonempty)
    return seq_mean / loss.shape[1] if mode == "seq-mean-token-sum-norm" else seq_mean


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_matches_naive_loop(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).long()
    mask[2] = 0
    assert_close(losses.aggregate(loss, mask, mode), torch.tensor(_naive_aggregate(loss, mask, mode)))


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregate_all_masked_is_zero(mode):
    out = losses.aggregate(torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool), mode)
    assert out.dtype == torch.float32 and float(out) == 0.0


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="valid modes: token-mean"):
        losses.aggregate(LOSS, MASK, "mean")


# --------------------------------------------------------------------------- ppo

# One row, 5 valid tokens + 1 masked token with absurd values. old_logprobs = 0, so ratio r = exp(logprobs).
# clip 0.2, dual clip 3. Per token (L1 = -A r, L2 = -A clip(r, 0.8, 1.2)):
#   t0 A=+1 r=1.5: L1=-1.5 L2=-1.2 -> max -1.2 (clipped, grad 0)
#   t1 A=+1 r=0.5: L1=-0.5 L2=-0.8 -> max -0.5 (unclipped, dL/dlogp = -A r = -0.5)
#   t2 A=-1 r=1.5: L1= 1.5 L2= 1.2 -> max 1.5, below the dual bound 3 (dL/dlogp = 1.5)
#   t3 A=-1 r=4.0: L1= 4.0 L2= 1.2 -> max 4.0, dual bound 3 wins -> 3 (dual-clipped, grad 0)
#   t4 A=-1 r=0.5: L1= 0.5 L2= 0.8 -> max 0.8 (clipped, grad 0)
# token-mean = (-1.2 - 0.5 + 1.5 + 3 + 0.8) / 5 = 0.72
# clipfrac = 2/5 (t0, t4); clipfrac_lower = 1/5 (t3)
# approx_kl = mean(-log r) = -(2 ln 1.5 + 2 ln 0.5 + ln 4) / 5 = -2 ln 1.5 / 5
RATIOS = [1.5, 0.5, 1.5, 4.0, 0.5, 10.0]
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 100.0]])
PPO_MASK = torch.tensor([[1, 1, 1, 1, 1, 0]])


def _ppo_inputs(**overrides):
    logprobs = torch.tensor([[math.log(r) for r in RATIOS]], requires_grad=True)
    inputs = dict(logprobs=logprobs, old_logprobs=torch.zeros(1, 6), advantages=ADV, response_mask=PPO_MASK)
    inputs.update(overrides)
    return inputs


def test_ppo_hand_values_and_gradients_per_clip_region():
    inputs = _ppo_inputs()
    loss, stats = losses.policy_loss("ppo", **inputs)
    assert_close(loss, torch.tensor(0.72))
    assert_close(stats["clipfrac"], torch.tensor(0.4))
    assert_close(stats["clipfrac_lower"], torch.tensor(0.2))
    assert_close(stats["approx_kl"], torch.tensor(-2 * math.log(1.5) / 5))
    loss.backward()
    # gradient only in the unclipped regions (t1, t2), divided by 5 tokens; zero elsewhere
    assert_close(inputs["logprobs"].grad, torch.tensor([[0.0, -0.5 / 5, 1.5 / 5, 0.0, 0.0, 0.0]]))


def test_ppo_asymmetric_clip():
    # clip_high 0.5: t0 (A=+1, r=1.5) is now inside [0.8, 1.5] -> L = -1.5 and t2/t3 L2 = 1.5
    # losses: -1.5, -0.5, 1.5, 3.0, 0.8 -> mean 0.66; clipfrac: only t4 -> 0.2
    loss, stats = losses.policy_loss("ppo", **_ppo_inputs(), clip_high=0.5)
    assert_close(loss, torch.tensor(0.66))
    assert_close(stats["clipfrac"], torch.tensor(0.2))


def _naive_ppo(logprobs, old, adv, mask, clip_low, clip_high, dual):
    total, count, clipped, lower = 0.0, 0, 0, 0
    for lp, o, a, m in zip(logprobs.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(),
                           mask.flatten().tolist()):
        if not m:
            continue
        r = math.exp(min(max(lp - o, -20), 20))
        l1, l2 = -a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high)
        loss = max(l1, l2)
        clipped += l2 > l1
        if a < 0 and loss > -a * dual:
            loss, lower = -a * dual, lower + 1
        total, count = total + loss, count + 1
    return total / count, clipped / count, lower / count


def test_ppo_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    logprobs, old = torch.randn(8, 6, generator=gen) - 1, torch.randn(8, 6, generator=gen) - 1
    adv = torch.randn(8, 6, generator=gen)
    mask = torch.rand(8, 6, generator=gen) > 0.3
    loss, stats = losses.policy_loss("ppo", logprobs=logprobs, old_logprobs=old, advantages=adv,
                                     response_mask=mask, clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    want_loss, want_clip, want_lower = _naive_ppo(logprobs, old, adv, mask, 0.2, 0.28, 2.0)
    assert_close(loss, torch.tensor(want_loss))
    assert_close(stats["clipfrac"], torch.tensor(want_clip))
    assert_close(stats["clipfrac_lower"], torch.tensor(want_lower))


def test_ppo_rejects_dual_clip_not_above_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        losses.policy_loss("ppo", **_ppo_inputs(), dual_clip=1.0)


def test_ppo_extreme_log_ratio_is_finite():
    inputs = _ppo_inputs(logprobs=torch.tensor([[80.0, -80.0, 0, 0, 0, 0]], requires_grad=True))
    loss, _ = losses.policy_loss("ppo", **inputs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(inputs["logprobs"].grad).all()


# --------------------------------------------------------------------------- gspo


def test_gspo_hand_values_and_gradient():
    # row 0: logprobs [ln 2, 0], old 0 -> s = exp((ln 2 + 0) / 2) = sqrt 2 = 1.41421, A = 1
    #        -> max(-1.41421, -1.2) = -1.2 on both tokens (clipped, no gradient)
    # row 1: logprobs [ln 0.9, ln 0.9] -> s = 0.9 inside [0.8, 1.2], A = 1 -> -0.9 on both tokens
    # seq-mean-token-mean = (-1.2 + -0.9) / 2 = -1.05 ; clipfrac = 2/4 tokens
    # gradient of row 1 tokens: (1/2 rows) * (1/2 tokens) * (-A s) = -0.225
    logprobs = torch.tensor([[math.log(2.0), 0.0], [math.log(0.9), math.log(0.9)]], requires_grad=True)
    loss, stats = losses.policy_loss("gspo", logprobs=logprobs, old_logprobs=torch.zeros(2, 2),
                                     advantages=torch.ones(2, 2), response_mask=torch.ones(2, 2),
                                     agg="seq-mean-token-mean")
    assert_close(loss, torch.tensor(-1.05))
    assert_close(stats["clipfrac"], torch.tensor(0.5))
    assert float(stats["clipfrac_lower"]) == 0.0
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0], [-0.225, -0.225]]))


def test_gspo_equals_sequence_level_objective():
    # GSPO sequence-level objective: J = mean_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t log ratio);
    # with seq-mean-token-mean the token form must give the same value and gradient.
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(5, 4, generator=gen) * 0.1 - 2
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    seq_adv = torch.randn(5, generator=gen)
    new = (old + torch.randn(5, 4, generator=gen) * 0.3).requires_grad_()
    loss, _ = losses.policy_loss("gspo", logprobs=new, old_logprobs=old, advantages=seq_adv[:, None].expand(5, 4),
                                 response_mask=mask, clip_low=0.1, clip_high=0.1, agg="seq-mean-token-mean")
    (grad,) = torch.autograd.grad(loss, new)
    new_ref = new.detach().clone().requires_grad_()
    s = torch.exp(((new_ref - old) * mask).sum(-1) / mask.sum(-1))
    ref = -torch.minimum(s * seq_adv, s.clamp(0.9, 1.1) * seq_adv).mean()
    (grad_ref,) = torch.autograd.grad(ref, new_ref)
    assert_close(loss, ref)
    assert_close(grad, grad_ref)


# --------------------------------------------------------------------------- reinforce and shared contract


def test_reinforce_hand_values():
    # L = -A logp: tokens (A, logp) = (2, -1), (-1, -2) -> 2, -2 -> token-mean 0
    # gradient dL/dlogp = -A / 2 tokens = [-1, 0.5]
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = losses.policy_loss("reinforce", logprobs=logprobs, old_logprobs=torch.tensor([[-1.0, -2.5]]),
                                     advantages=torch.tensor([[2.0, -1.0]]), response_mask=torch.ones(1, 2))
    assert_close(loss, torch.tensor(0.0))
    assert float(stats["clipfrac"]) == 0.0
    assert_close(stats["approx_kl"], torch.tensor(-0.25))  # mean(old - new) = (0 - 0.5) / 2
    loss.backward()
    assert_close(logprobs.grad, torch.tensor([[-1.0, 0.5]]))


def test_cispo_clips_the_weight_but_keeps_every_tokens_gradient():
    # 3 valid tokens (t3 masked); ratio r = exp(new - old) = [1, 2, 0.5, 1]; eps_low 0.2, eps_high 0.28
    # clipped weight w = clip(r, 0.8, 1.28) = [1, 1.28, 0.8, 1] (a constant: stop-gradient)
    # token loss -w A log pi: t0 -1*1*(-1) = 1; t1 -1.28*1*(-2) = 2.56; t2 -0.8*(-1)*(-0.5) = -0.4
    # token-mean = (1 + 2.56 - 0.4) / 3 = 3.16 / 3; d loss / d log pi_t = -w_t A_t / 3
    new = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    log_ratio = torch.tensor([[0.0, math.log(2.0), math.log(0.5), 0.0]])
    inputs = {"old_logprobs": new.detach() - log_ratio, "advantages": torch.tensor([[1.0, 1.0, -1.0, 5.0]]),
              "response_mask": torch.tensor([[1, 1, 1, 0]]), "clip_low": 0.2, "clip_high": 0.28}
    loss, stats = losses.policy_loss("cispo", logprobs=new, **inputs)
    assert_close(loss, torch.tensor(3.16 / 3))
    assert_close(stats["clipfrac"], torch.tensor(1 / 3))        # t1: r = 2 > 1.28
    assert_close(stats["clipfrac_lower"], torch.tensor(1 / 3))  # t2: r = 0.5 < 0.8
    assert_close(stats["approx_kl"], torch.tensor(0.0))         # (0 - ln 2 + ln 2) / 3
    loss.backward()
    assert_close(new.grad, torch.tensor([[-1.0, -1.28, 0.8, 0.0]]) / 3)
    # PPO drops t1's gradient (A > 0 and r above the clip range); CISPO only scales it
    ppo_new = new.detach().clone().requires_grad_()
    losses.policy_loss("ppo", logprobs=ppo_new, **inputs)[0].backward()
    assert float(ppo_new.grad[0, 1]) == 0.0


@pytest.mark.parametrize("name", losses.policy_loss_names())
@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_policy_loss_contract(name, agg):
    gen = torch.Generator().manual_seed(2)
    logprobs = (torch.randn(3, 4, generator=gen) - 1).bfloat16().requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    loss, stats = losses.policy_loss(name, logprobs=logprobs, old_logprobs=logprobs.detach() + 0.1,
                                     advantages=torch.randn(3, 4, generator=gen), response_mask=mask, agg=agg)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and torch.isfinite(loss)
    assert set(stats) == {"clipfrac", "clipfrac_lower", "approx_kl"}
    for value in stats.values():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad
    loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16
    assert (logprobs.grad.float()[mask == 0] == 0).all()


def test_policy_loss_errors():
    with pytest.raises(ValueError, match="valid names: cispo, gspo, ppo, reinforce"):
        losses.policy_loss("ppo2", **_ppo_inputs())
    with pytest.raises(ValueError, match="aggregation mode"):
        losses.policy_loss("ppo", **_ppo_inputs(), agg="sum")
    with pytest.raises(ValueError, match="share one"):
        losses.policy_loss("ppo", **_ppo_inputs(advantages=torch.zeros(1, 5)))


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_values_and_gradient():
    # clip 0.5, v_clipped = clamp(v, v_old - 0.5, v_old + 0.5):
    #   t0 v=1, v_old=0.8, R=2: v_c=1   -> (1-2)^2 = 1 both ; grad 2(v-R) = -2
    #   t1 v=2, v_old=0.5, R=3: v_c=1   -> unclipped 1, clipped 4 -> 4 (clipped wins, grad 0)
    #   t2 v=2, v_old=0.5, R=1: v_c=1   -> unclipped 1, clipped 0 -> 1 ; grad 2(v-R) = 2
    #   t3 masked
    # loss = 0.5 * (1 + 4 + 1) / 3 = 1.0 ; vf_clipfrac = 1/3 ; dloss/dv = 0.5/3 * [-2, 0, 2, 0]
    values = torch.tensor([[1.0, 2.0, 2.0, 7.0]], requires_grad=True)
    loss, stats = losses.value_loss(values=values, old_values=torch.tensor([[0.8, 0.5, 0.5, 0.0]]),
                                    returns=torch.tensor([[2.0, 3.0, 1.0, 0.0]]),
                                    response_mask=torch.tensor([[True, True, True, False]]))
    assert_close(loss, torch.tensor(1.0))
    assert_close(stats["vf_clipfrac"], torch.tensor(1 / 3))
    assert not stats["vf_clipfrac"].requires_grad
    loss.backward()
    assert_close(values.grad, torch.tensor([[-1 / 3, 0.0, 1 / 3, 0.0]]))


def test_value_loss_bf16_and_agg():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0]]).bfloat16()
    loss, _ = losses.value_loss(values=values, old_values=values, returns=torch.zeros(2, 2),
                                response_mask=torch.tensor([[1, 1], [1, 0]]), agg="seq-mean-token-sum")
    # clip has no effect (v = v_old); rows: (1 + 4) and 9 -> mean 7 -> 0.5 * 7
    assert loss.dtype == torch.float32
    assert_close(loss, torch.tensor(3.5))
