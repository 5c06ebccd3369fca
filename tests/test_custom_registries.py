"""KL estimators and DPO losses of the user's own: registered by a plugin or referenced as
`file.py:fn`, wherever a config takes a built-in name. The user functions differ from every
built-in (an absolute-value k1, a hinge loss), so a lookup that fell back to a built-in fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import raygraph
from raygraph.algos import dpo, kl
from raygraph.config import ConfigError, load_config

TOY = Path(__file__).resolve().parents[1] / "configs" / "grpo_toy.yaml"
USER = '''
import torch


def my_k1(*, logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).abs()


def my_sigmoid(*, margin, beta):   # a hinge on the margin (SLiC), not DPO's sigmoid
    return torch.relu(1 - beta * margin)


def wrong(logprobs):
    return logprobs
'''


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "my_terms.py"
    path.write_text(USER)
    return path


def test_a_referenced_kl_estimator_is_the_users_and_has_a_straight_through_form(user_file):
    lp, ref = torch.tensor([[0.5, -1.0, 2.0]], requires_grad=True), torch.tensor([[1.0, -1.5, 2.0]])
    mine = kl.estimate(lp, ref, f"{user_file}:my_k1")
    assert mine.tolist() == [[0.5, 0.5, 0.0]]   # |lp - ref|; the built-in k1 gives [-0.5, 0.5, 0]
    st = kl.estimate(lp, ref, f"{user_file}:my_k1+")   # value of the user's, gradient of k2 = (lp - ref)
    assert st.tolist() == [[0.5, 0.5, 0.0]]
    st.sum().backward()
    torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_a_referenced_dpo_loss_is_the_users(user_file):
    # margins h = (chosen - ref_chosen) - (rejected - ref_rejected) = 2, -1; beta 0.25:
    # hinge relu(1 - 0.25 h) = 0.5, 1.25 -> mean 0.875 (the built-in sigmoid gives 0.6500)
    kwargs = {"chosen_logps": torch.tensor([-1.0, -3.0]), "rejected_logps": torch.tensor([-2.0, -2.0]),
              "ref_chosen_logps": torch.tensor([-2.0, -2.0]), "ref_rejected_logps": torch.tensor([-1.0, -2.0])}
    mine, _ = dpo.dpo_loss(**kwargs, beta=0.25, kind=f"{user_file}:my_sigmoid")
    assert float(mine) == pytest.approx(0.875, abs=1e-6)
    assert float(dpo.dpo_loss(**kwargs, beta=0.25, kind="sigmoid")[0]) == pytest.approx(0.65001, abs=1e-4)


@pytest.fixture
def restored_registries():
    """What a test registers is removed afterwards (the registries are global)."""
    saved = [(r, dict(r._entries), dict(r._info)) for r in (kl._ESTIMATORS, dpo._KINDS)]
    yield
    for registry, entries, info in saved:
        registry._entries, registry._info = entries, info


def test_registering_a_kl_estimator_and_a_dpo_loss(user_file, restored_registries):
    name = "test_registered_k1"
    fn = raygraph.register_kl_estimator(name)(lambda *, logprobs, ref_logprobs: 2 * (logprobs - ref_logprobs))
    assert fn is not None and name in kl.names() and f"{name}+" in kl.names()
    assert float(kl.estimate(torch.ones(1, 1), torch.zeros(1, 1), name)) == 2.0
    with pytest.raises(ValueError, match="already registered"):
        raygraph.register_kl_estimator(name, fn)
    with pytest.raises(ValueError, match=r"must take the keyword arguments \(margin, beta\)"):
        raygraph.register_dpo_loss("test_bad_dpo", lambda x: x)


def test_the_config_takes_references_and_names_what_is_wrong(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)   # relative references are stored absolute, for every actor
    cfg = load_config(TOY, ["actor.kl_loss_kind=my_terms.py:my_k1", "actor.kl_loss_coef=0.1",
                            "algorithm.kl_in_reward.kind=my_terms.py:my_k1+", "algorithm.dpo_loss=my_terms.py:my_sigmoid"])
    assert cfg.actor.kl_loss_kind == f"{user_file}:my_k1"
    assert cfg.algorithm.kl_in_reward.kind == f"{user_file}:my_k1+"
    assert cfg.algorithm.dpo_loss == f"{user_file}:my_sigmoid"
    with pytest.raises(ConfigError) as err:
        load_config(TOY, [f"actor.kl_loss_kind={user_file}:wrong"])
    assert "must take the keyword arguments (logprobs, ref_logprobs)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(TOY, ["actor.kl_loss_kind=k4"])
    assert "actor.kl_loss_kind='k4' is not a known KL estimator" in str(err.value)
