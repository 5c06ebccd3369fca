"""Data checked before training (`raygraph validate` and the start of `train`): each case used to
fail at the step where the bad row was first drawn, or not at all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raygraph.cli import main
from raygraph.data.prompts import write_rows

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")


def _row(i: int, source: str = "toy_arith", truth: str | None = "7") -> dict:
    return {"prompt": [{"role": "user", "content": f"{i}+0="}], "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"i": i}}


def _validate(tmp_path, model: str, rows: list[dict], *overrides: str) -> int:
    train = write_rows(rows, tmp_path / "train.parquet")
    return main(["validate", TOY, f"model.path={model}", "model.tiny=null", f"data.train_files=[{train}]",
                 "data.val_files=[]", "trainer.val_every=0", "data.prompts_per_step=4",
                 f"trainer.output_dir={tmp_path / 'runs'}", *overrides])


def test_good_data_passes_and_says_so(tmp_path, tiny_model_path, capsys):
    assert _validate(tmp_path, tiny_model_path, [_row(i) for i in range(8)]) == 0
    assert "# data OK: 8 training rows, 0 validation prompts\nconfig OK\n" in capsys.readouterr().out


def test_every_data_problem_is_named_before_training(tmp_path, tiny_model_path, capsys):
    rows = [_row(0, source="my/new_task"), _row(1, truth=None), _row(2)]
    assert _validate(tmp_path, tiny_model_path, rows) == 2
    err = capsys.readouterr().err
    assert "3 data problem(s)" in err
    assert "data.prompts_per_step=4 is larger than the training set (3 usable rows" in err
    assert "no rule reward for data_source 'my/new_task' (1 rows); known data sources: " in err
    assert "1 rows have no reward_model.ground_truth (first: prompt 1" in err
    assert "Traceback" not in err


def test_a_named_reward_function_needs_no_per_source_reward(tmp_path, tiny_model_path):
    rows = [_row(i, source="my/new_task") for i in range(4)]
    assert _validate(tmp_path, tiny_model_path, rows, "reward.function=toy_arith") == 0


def test_an_empty_parquet_file_is_named_as_such(tmp_path, tiny_model_path, capsys):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    code = main(["validate", TOY, f"model.path={tiny_model_path}", "model.tiny=null",
                 f"data.train_files=[{empty}]", "data.val_files=[]", "trainer.val_every=0"])
    assert code == 2
    assert f"data file {empty} is empty (0 rows)" in capsys.readouterr().err


def test_a_pad_id_outside_the_vocabulary_is_caught(tmp_path, tiny_model_path, capsys):
    # transformers 5 gave a 93-token model the pad id 93 and step 2 crashed with IndexError
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"pad_token": "<|newpad|>"})     # id 93, the model has ids 0..92
    tok.save_pretrained(model)
    assert _validate(tmp_path, str(model), [_row(i) for i in range(8)]) == 2
    err = capsys.readouterr().err
    assert "the tokenizer's pad id 93 is outside the model's vocabulary (93 ids" in err


def test_a_misspelt_model_path_fails_clearly_and_never_builds_a_random_model(tmp_path, capsys):
    # before model.tiny: a misspelt path under the output folder was built as a random model
    typo = tmp_path / "runs" / "models" / "my-modle"
    code = main(["validate", TOY, f"model.path={typo}", f"trainer.output_dir={tmp_path / 'runs'}"])
    assert code == 2           # the toy config names a tiny model: a path beside it is a second spelling
    assert f"model.path='{typo}' with model.tiny='tiny': a tiny model is built (or reused) at " in \
        capsys.readouterr().err
    real = [f"model.path={typo}", "model.tiny=null", f"trainer.output_dir={tmp_path / 'runs'}"]
    assert main(["validate", TOY, *real]) == 2
    assert f"model.path {typo} does not exist (working directory " in capsys.readouterr().err
    code = main(["train", TOY, *real, "logging.mlflow=false"])
    err = capsys.readouterr().err
    assert code == 2 and f"MissingInput: model.path {typo} does not exist" in err, err
    assert "never replaced by a random one" in err and "Traceback" not in err
    assert not typo.exists() and not (tmp_path / "runs").exists()    # no model, no run directory


def test_a_hub_id_is_not_taken_for_a_missing_directory(tmp_path):
    from raygraph.config import load_config
    from raygraph.run.setup import check_model_path

    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2"):
        check_model_path(load_config(TOY, [f"model.path={hub_id}", "model.tiny=null"]))
    for local in ("./my-model", "runs/models/my-model", str(tmp_path / "m"), "~/models/m"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            check_model_path(load_config(TOY, [f"model.path={local}", "model.tiny=null"]))


def test_model_tiny_builds_under_the_output_dir_and_says_so_loudly(tmp_path, capsys):
    from raygraph.config import load_config
    from raygraph.run.setup import ensure_assets

    cfg = load_config(TOY, [f"trainer.output_dir={tmp_path / 'runs'}",
                            f"data.train_files=[{tmp_path / 'd' / 'train.parquet'}]",
                            f"data.val_files=[{tmp_path / 'd' / 'val.parquet'}]"])
    ensure_assets(cfg)
    assert (tmp_path / "runs" / "models" / "tiny-tiny" / "config.json").is_file()
    assert "model.tiny=tiny: building a RANDOM-INIT tiny model at" in capsys.readouterr().out
    ensure_assets(cfg)
    assert "model.tiny=tiny: using the RANDOM-INIT tiny model at" in capsys.readouterr().out
    small = load_config(TOY, [f"trainer.output_dir={tmp_path / 'runs'}", "model.tiny=small"])
    (tmp_path / "runs" / "models" / "tiny-small").mkdir()
    (tmp_path / "runs" / "models" / "tiny-tiny" / "config.json").rename(
        tmp_path / "runs" / "models" / "tiny-small" / "config.json")   # a folder holding another preset
    with pytest.raises(ValueError, match=r"tiny-small holds a tiny model of size 'tiny', not model.tiny='small'"):
        ensure_assets(small)


@pytest.mark.parametrize("bad", ["not parquet at all"])
def test_a_file_that_is_not_parquet_is_named(tmp_path, tiny_model_path, capsys, bad):
    path = tmp_path / "train.parquet"
    path.write_text(bad)
    code = main(["validate", TOY, f"model.path={tiny_model_path}", "model.tiny=null",
                 f"data.train_files=[{path}]", "data.val_files=[]", "trainer.val_every=0"])
    assert code == 2
    assert f"data file {path} is not a readable parquet file" in capsys.readouterr().err


def test_a_bundle_larger_than_the_local_machine_is_refused_up_front():
    # before: cpus_per_worker=64 on 2 cores ran OMP_NUM_THREADS=64 per actor, 10x slower, no error
    from raygraph.config import load_config
    from raygraph.run.setup import _bundle_cpus, check_local_cpus

    check_local_cpus(_bundle_cpus(load_config(TOY, ["placement.cpus_per_worker=2"])), machine_cpus=2)
    with pytest.raises(ValueError, match=r"placement.cpus_per_worker=64 is more than this machine's 2 CPUs"):
        check_local_cpus(_bundle_cpus(load_config(TOY, ["placement.cpus_per_worker=64"])), machine_cpus=2)
    with pytest.raises(ValueError, match=r"placement.pools.gen.cpus_per_bundle=3 is more than this machine's 2"):
        check_local_cpus([("placement.pools.gen.cpus_per_bundle", 3.0)], machine_cpus=2)
