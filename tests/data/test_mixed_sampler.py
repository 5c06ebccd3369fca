"""data.train_weights: training files mixed in fixed proportions (MixedSampler), resumable, with
uids that differ whenever a prompt comes round again."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest

from raygraph.config import ConfigError, load_config
from raygraph.data.sampler import MixedSampler
from raygraph.data.toy import write_toy_dataset

TOY = Path(__file__).resolve().parents[2] / "configs" / "grpo_toy.yaml"


def test_every_batch_holds_each_source_in_proportion():
    # sources of 10 and 30 items (indices 0-9 and 10-39), weights 7:3, 10 per batch -> 7 + 3 each batch
    sampler = MixedSampler([10, 30], [0.7, 0.3], batch_size=10, seed=0)
    batches = [sampler.next_indices() for _ in range(10)]
    assert all(sum(i < 10 for i in b) == 7 for b in batches)
    drawn = Counter(i for b in batches for i in b)
    assert all(drawn[i] == 7 for i in range(10))        # 70 draws: source 0 seven times over
    assert all(drawn[i] == 1 for i in range(10, 40))    # 30 draws: source 1 exactly once
    assert sampler.epochs[:7] and max(sampler.epochs) == 6   # source 0 is in its 7th epoch


def test_uneven_weights_stay_within_one_item_of_their_share():
    sampler = MixedSampler([5, 7, 11], [1, 2, 4], batch_size=3, seed=1)
    counts = [0, 0, 0]
    for step in range(1, 30):
        for i in sampler.next_indices():
            counts[0 if i < 5 else 1 if i < 12 else 2] += 1
        assert all(abs(c - w / 7 * 3 * step) < 1 for c, w in zip(counts, (1, 2, 4))), (step, counts)


def test_a_resumed_mix_continues_exactly():
    sampler = MixedSampler([4, 9], [0.5, 0.5], batch_size=4, seed=3)
    for _ in range(5):
        sampler.next_indices()
    state = copy.deepcopy(sampler.state_dict())
    expected = [sampler.next_indices() for _ in range(6)]
    resumed = MixedSampler([4, 9], [1, 1], batch_size=4, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(6)] == expected
    with pytest.raises(ValueError, match="would change the data order"):
        MixedSampler([4, 9], [0.3, 0.7], batch_size=4, seed=3).load_state_dict(state)


def test_the_run_feed_mixes_the_configured_files(tmp_path, tiny_model_path):
    from raygraph.run.feed import StepData

    write_toy_dataset(tmp_path / "a", n_train=8, n_val=4, seed=0)
    write_toy_dataset(tmp_path / "b", n_train=40, n_val=4, seed=1)
    cfg = load_config(TOY, [f"model.path={tiny_model_path}", "model.tiny=null", "data.toy=null",
                            f"data.train_files=[{tmp_path}/a/train.parquet, {tmp_path}/b/train.parquet]",
                            "data.train_weights=[3, 1]", f"data.val_files=[{tmp_path}/a/val.parquet]"])
    data = StepData.load(cfg)
    uids = []
    for step in range(1, 9):
        batch = data.next_prompts(step=step, kl_coef=0.0)
        index = [int(u.rsplit("-", 1)[1]) for u in batch["uid"]]
        assert sum(i < 8 for i in index) == 3   # 3 of 4 prompts from the first file (rows 0-7)
        uids += list(batch["uid"])
    assert len(uids) == 32 and len(set(uids)) == 32   # file a came round 3 times, each time new uids


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.train_weights=[1, 2]"], "data.train_weights has 2 weights for 1 files"),
    (["data.train_weights=[0]"], "every weight must be > 0"),
    (["data.train_weights=[1]", "data.format=sft", "data.train_files=[x.parquet]", "data.toy=null",
      "algorithm.advantage=null", "workflow=sft"], "data.format=sft is not mixed yet"),
])
def test_bad_weights_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(TOY, overrides)
