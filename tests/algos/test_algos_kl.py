"""KL estimators (values, aliases, straight-through gradients) and KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from raygraph.algos import kl
from raygraph.algos.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller

# logprobs = 0, ref_logprobs = ln 2 -> d = logp - ref = -ln 2
#   k1 = -0.693147 ; abs = 0.693147 ; k2 = 0.5 ln(2)^2 = 0.240227
#   k3: r = ref/p = 2 -> r - 1 - ln r = 1 - ln 2 = 0.306853
LN2 = math.log(2.0)
HAND = {"k1": -LN2, "abs": LN2, "k2": 0.5 * LN2**2, "k3": 1.0 - LN2}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def test_names_lists_every_kind():
    base = {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}
    assert set(kl.names()) == base | {b + "+" for b in base}


@pytest.mark.parametrize("kind", kl.names())
def test_hand_values_and_aliases(kind):
    canonical = ALIASES.get(kind.rstrip("+"), kind.rstrip("+"))
    est = kl.estimate(torch.zeros(1, 1), torch.full((1, 1), LN2), kind)
    assert est.dtype == torch.float32
    assert_close(est, torch.tensor([[HAND[canonical]]]))


def test_k3_is_nonnegative_and_clamped():
    # d = -30: -d = 30 clamps to 20, exp(20) - 21 ~ 4.9e8 then clamps to 10
    # d = +30: log r = -20 after the clamp, exp(-20) - 1 + 20 ~ 19 -> clamped to 10
    logprobs = torch.tensor([[-30.0, 30.0, 0.3, -0.3]])
    est = kl.estimate(logprobs, torch.zeros(1, 4), "k3")
    assert_close(est[0, :2], torch.tensor([10.0, 10.0]))
    assert (est >= 0).all() and torch.isfinite(est).all()


def test_k3_gradient():
    # d/dlogp [exp(-d) + d - 1] = 1 - exp(-d); with d = ln 2 - 0 -> 1 - 0.5 = 0.5
    logprobs = torch.tensor([[LN2]], requires_grad=True)
    kl.estimate(logprobs, torch.zeros(1, 1), "k3").sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.5]]))


@pytest.mark.parametrize("kind", [k for k in kl.names() if k.endswith("+")])
def test_straight_through_keeps_value_with_k2_gradient(kind):
    gen = torch.Generator().manual_seed(0)
    logprobs = (torch.randn(3, 4, generator=gen) - 1).requires_grad_()
    ref = torch.randn(3, 4, generator=gen) - 1
    est = kl.estimate(logprobs, ref, kind)
    assert_close(est, kl.estimate(logprobs.detach(), ref, kind.rstrip("+")))
    (grad,) = torch.autograd.grad(est.sum(), logprobs)
    # gradient of 0.5 d^2 is d = logp - ref
    assert_close(grad, (logprobs - ref).detach())


def test_reference_gets_no_gradient_and_bf16_inputs():
    logprobs = torch.tensor([[-1.0, -2.0]]).bfloat16().requires_grad_()
    ref = torch.tensor([[-1.5, -1.0]]).bfloat16().requires_grad_()
    est = kl.estimate(logprobs, ref, "low_var_kl+")
    assert est.dtype == torch.float32
    est.sum().backward()
    assert ref.grad is None and logprobs.grad is not None


def test_unknown_kind_lists_names():
    with pytest.raises(ValueError, match=r"valid names: abs, abs\+, k1"):
        kl.estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(ValueError, match="valid names"):
        kl.estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k3++")


# --------------------------------------------------------------------------- controllers


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_hand_values():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5 -> clipped 0.2 ; beta *= 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # KL 3: error -0.5 -> -0.2 ; beta *= 1 - 0.2 * 1000 / 10000 = 0.98
    ctl.update(current_kl=3.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.98)
    # KL 6.6: error 0.1 (inside the clip) ; beta *= 1 + 0.1 * 500 / 10000 = 1.005
    ctl.update(current_kl=6.6, n_steps=500)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.98 * 1.005)


def test_adaptive_controller_resume_reproduces_trajectory():
    a = AdaptiveKLController(0.2, target=1.0, horizon=100)
    a.update(2.0, 10)
    b = AdaptiveKLController(0.2, target=1.0, horizon=100)
    b.load_state_dict(a.state_dict())
    for ctl in (a, b):
        ctl.update(0.5, 7)
    assert a.value == b.value


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.1), FixedKLController)
    ctl = make_kl_controller("adaptive", 0.1, target=6.0, horizon=10000)
    assert isinstance(ctl, AdaptiveKLController) and ctl.value == 0.1
    with pytest.raises(ValueError, match="target and horizon"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.1, target=1.0)
    with pytest.raises(ValueError, match="valid kinds: adaptive, fixed"):
        make_kl_controller("linear", 0.1)
    with pytest.raises(ValueError, match="> 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
