"""The critic model: loads from a causal-LM checkpoint, saves and reloads exactly."""

from __future__ import annotations

import torch

from raygraph.models.value_head import VALUE_HEAD_FILE, ValueModel


def test_value_model_from_causal_lm_save_and_reload(tiny_model_path, tmp_path):
    critic = ValueModel.from_pretrained(tiny_model_path, seed=3)
    again = ValueModel.from_pretrained(tiny_model_path, seed=3)
    assert torch.equal(critic.v_head.weight, again.v_head.weight)  # same seed, same head on every rank
    ids = torch.randint(6, 90, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = critic(ids, mask)
        critic.v_head.bias.fill_(0.25)  # make the saved head differ from any fresh init
        values = critic(ids, mask)
    assert values.shape == (2, 9) and values.dtype == torch.float32
    critic.save_pretrained(tmp_path)
    assert (tmp_path / VALUE_HEAD_FILE).exists()
    reloaded = ValueModel.from_pretrained(tmp_path, seed=99)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, mask), values, atol=0, rtol=0)
