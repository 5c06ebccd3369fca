"""Entropy, DPO losses, the registry helper, masked reductions and the package's purity."""

from __future__ import annotations

import ast
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import raygraph.algos
from raygraph.algos import advantages, dpo, kl, losses, masked
from raygraph.algos._registry import Registry
from raygraph.algos.entropy import entropy_from_logits

# --------------------------------------------------------------------------- entropy


def _naive_entropy(logits):
    p = torch.softmax(logits.double(), -1)
    return -(p * torch.log(p)).nan_to_num().sum(-1)


def test_entropy_hand_values():
    # uniform over 4 -> ln 4 ; [0, 0, -inf] -> uniform over 2 -> ln 2 ; one huge logit -> ~0 (no overflow)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf], [1000.0, 0.0, 0.0, 0.0]])
    assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), math.log(2), 0.0]))


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_entropy_chunked_matches_naive(chunk_size):
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0)) * 3
    out = entropy_from_logits(logits, chunk_size=chunk_size)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    assert_close(out.double(), _naive_entropy(logits), atol=1e-5, rtol=1e-5)


def test_entropy_gradient_through_checkpointed_chunks():
    logits = (torch.randn(2, 6, 30, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
    weights = torch.arange(12.0).reshape(2, 6)
    (grad,) = torch.autograd.grad((entropy_from_logits(logits, chunk_size=5) * weights).sum(), logits)
    ref_logits = logits.detach().double().requires_grad_()
    (grad_ref,) = torch.autograd.grad((_naive_entropy(ref_logits) * weights).sum(), ref_logits)
    assert_close(grad.double(), grad_ref, atol=1e-5, rtol=1e-5)


def test_entropy_bf16_and_empty():
    logits = torch.randn(4, 16).bfloat16()
    out = entropy_from_logits(logits)
    assert out.dtype == torch.float32
    assert_close(out.double(), _naive_entropy(logits.float()), atol=1e-5, rtol=1e-5)
    assert entropy_from_logits(torch.zeros(0, 3, 8)).shape == (0, 3)


# --------------------------------------------------------------------------- dpo

# beta 0.1; pair 0: chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1 -> h = 2
#           pair 1: chosen 0, rejected -1 - (-2) = 1 -> h = -1
# sigmoid: mean(log(1 + e^{-0.2}), log(1 + e^{0.1})) = mean(0.598139, 0.744397) = 0.671268
# ipo: mean((2 - 5)^2, (-1 - 5)^2) = (9 + 36) / 2 = 22.5
# rewards chosen [0.1, 0], rejected [-0.1, 0.1]: means 0.05, 0 ; accuracy 1/2 ; margin mean(0.2, -0.1) = 0.05
DPO_INPUTS = dict(rejected_logps=torch.tensor([-3.0, -1.0]), ref_chosen_logps=torch.tensor([-2.0, -2.0]),
                  ref_rejected_logps=torch.tensor([-2.0, -2.0]))


@pytest.mark.parametrize(("kind", "expected"), [("sigmoid", 0.671268), ("ipo", 22.5)])
def test_dpo_hand_values(kind, expected):
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = losses.dpo_loss(chosen_logps=chosen, **DPO_INPUTS, beta=0.1, kind=kind)
    assert_close(loss, torch.tensor(expected))
    assert_close(stats["rewards/chosen"], torch.tensor(0.05))
    assert_close(stats["rewards/rejected"], torch.tensor(0.0))
    assert_close(stats["rewards/accuracy"], torch.tensor(0.5))
    assert_close(stats["rewards/margin"], torch.tensor(0.05))
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    loss.backward()
    h = torch.tensor([2.0, -1.0])
    if kind == "sigmoid":  # d/dh -log sigmoid(beta h) = -beta sigmoid(-beta h), averaged over 2 pairs
        expected_grad = -0.1 * torch.sigmoid(-0.1 * h) / 2
    else:  # d/dh (h - 5)^2 = 2 (h - 5), averaged over 2 pairs
        expected_grad = 2 * (h - 5) / 2
    assert_close(chosen.grad, expected_grad)


def test_dpo_errors():
    with pytest.raises(ValueError, match="valid names: ipo, sigmoid"):
        losses.dpo_loss(chosen_logps=torch.zeros(2), **DPO_INPUTS, kind="hinge")
    with pytest.raises(ValueError, match="beta"):
        losses.dpo_loss(chosen_logps=torch.zeros(2), **DPO_INPUTS, beta=0.0)
    assert dpo.names() == ("ipo", "sigmoid")


# --------------------------------------------------------------------------- registries


def test_registry_helper_on_a_fresh_instance():
    reg = Registry("widget")

    @reg.register("a", "alias_a")
    def _a():
        return 1

    assert reg.names() == ("a", "alias_a") and reg.get("alias_a") is _a and "a" in reg
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match="unknown widget 'b'; valid names: a, alias_a"):
        reg.get("b")


@pytest.mark.parametrize(
    ("registry", "names"),
    [(advantages._ESTIMATORS, advantages.names()), (losses._POLICY_LOSSES, losses.policy_loss_names()),
     (kl._ESTIMATORS, kl._ESTIMATORS.names()), (dpo._KINDS, dpo.names())],
)
def test_every_family_shares_one_signature(registry, names):
    signatures = {name: list(inspect.signature(registry.get(name)).parameters) for name in names}
    assert len({tuple(s) for s in signatures.values()}) == 1, signatures


# --------------------------------------------------------------------------- masked helpers, purity


def test_masked_helpers():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert_close(masked.masked_mean(x, mask), torch.tensor(2.0))
    assert_close(masked.masked_var(x, mask), torch.tensor(2.0))  # ((1-2)^2 + (3-2)^2) / (2 - 1)
    assert_close(masked.masked_mean(x, mask, dim=-1), torch.tensor([2.0]))
    assert float(masked.masked_var(x, torch.tensor([[0, 1, 0]]))) == 0.0  # one value: no spread
    assert float(masked.masked_mean(x, torch.zeros(1, 3))) == 0.0


def test_package_is_pure_torch():
    # no Ray, no config objects: the algos package imports only torch, stdlib and itself (the
    # standard library's importlib and inspect included: user_code.py imports plugins), and the
    # error base classes (raygraph.errors), which every layer may raise
    allowed = {"torch", "raygraph", *sys.stdlib_module_names}
    for path in Path(raygraph.algos.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
                if node.module and node.module.startswith("raygraph.") and not node.module.startswith(("raygraph.algos", "raygraph.errors")):
                    pytest.fail(f"{path.name} imports {node.module}")
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"
