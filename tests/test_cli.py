"""The `raygraph` command line: validate, check-env, data, train, and their exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raygraph import check_env as check_env_module
from raygraph.cli import main

ROOT = Path(__file__).resolve().parents[1]
TOY = str(ROOT / "configs" / "grpo_toy.yaml")
DEMO = str(ROOT / "configs" / "demo.yaml")

# Runs `raygraph validate` in a fresh interpreter and fails if Ray was imported on the way.
VALIDATE_WITHOUT_RAY = """
import sys
from raygraph.cli import main
code = main(["validate", *sys.argv[1:]])
assert "ray" not in sys.modules, "raygraph validate imported ray"
sys.exit(code)
"""


def _validate_subprocess(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", VALIDATE_WITHOUT_RAY, *args], capture_output=True,
                            text=True, cwd=ROOT, timeout=60)
    return result, time.monotonic() - start


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_validate_ok_prints_resolved_config_without_ray():
    result, seconds = _validate_subprocess(TOY, "rollout.n=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("config OK\n")
    resolved = yaml.safe_load(result.stdout.removesuffix("config OK\n"))
    assert resolved["rollout"]["n"] == 8 and resolved["trainer"]["resume"] == "never"
    assert seconds < 20, f"validate took {seconds:.1f} s"


def test_validate_of_a_hub_model_offline_checks_the_data_files_and_says_what_it_skipped(tmp_path, monkeypatch,
                                                                                         capsys):
    from raygraph.data.toy import write_toy_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # and the model is not in this machine's cache
    gpu = str(ROOT / "configs" / "qwen2.5-0.5b_gsm8k_1gpu.yaml")
    assert main(["validate", gpu]) == 2   # its data files are not on this machine: a real problem
    assert "data files not found: data/gsm8k/train.parquet, data/gsm8k/test.parquet" in capsys.readouterr().err
    write_toy_dataset(tmp_path / "toy", n_train=8, n_val=4, seed=0)
    files = [f"data.train_files=[{tmp_path / 'toy' / 'train.parquet'}]",
             f"data.val_files=[{tmp_path / 'toy' / 'val.parquet'}]"]
    assert main(["validate", gpu, *files]) == 0
    out = capsys.readouterr().out
    assert ("# data files found; the checks that need the tokenizer (prompt lengths, chat template) are skipped: "
            "Qwen/Qwen2.5-0.5B-Instruct is not in the local Hugging Face cache and HF_HUB_OFFLINE is set") in out
    assert out.endswith("config OK\n")


def test_the_hub_probe_says_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    from raygraph.models.hub import hub_unreachable

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # the discard port: nothing listens
    reason = hub_unreachable("Qwen/Qwen2.5-0.5B-Instruct", cache_dir=str(tmp_path / "empty_hf_cache"))
    assert reason is not None and "127.0.0.1:9 cannot be reached" in reason
    assert hub_unreachable("not a repo id!") is None   # loading names what is wrong with it


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_validate_misspelled_key_exits_2_with_path_and_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TOY).read_text().replace("  n: 4\n", "  n: 4\n  temprature: 0.7\n"))
    result, seconds = _validate_subprocess(str(bad), "actor.lr=1e-5")
    assert result.returncode == 2
    assert "rollout.temprature is not a field; did you mean rollout.temperature?" in result.stderr
    assert "override actor.lr=1e-5: actor.lr is not a field; did you mean actor.optim.lr?" in result.stderr
    assert "config OK" not in result.stdout
    assert seconds < 20, f"validate took {seconds:.1f} s"


@pytest.mark.slow   # a subprocess (or two torch ranks): not in `make test-fast`
def test_validate_builds_the_graph_and_names_a_misspelt_method_without_ray(tmp_path):
    algo = tmp_path / "algo.py"
    algo.write_text("from raygraph.graph import InputNode, MultiOutputNode\n\n"
                    "def build(roles, cfg):\n"
                    "    with InputNode() as prompts:\n"
                    "        return MultiOutputNode([roles.gather(roles.policy.bind('updat', prompts))])\n")
    result, _ = _validate_subprocess(TOY, f"workflow={algo}:build")
    assert result.returncode == 2, result.stderr
    assert "role 'policy' (PolicyWorker) has no method 'updat'; valid methods: " in result.stderr
    assert "update" in result.stderr and "Traceback" not in result.stderr


def test_validate_in_process(capsys):
    assert main(["validate", TOY]) == 0
    assert capsys.readouterr().out.endswith("config OK\n")
    assert main(["validate", TOY, "rollout.n=1", "rollout.top_p=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"2 config problems in {TOY}:")


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  success", "1  check-env found problems", "2  invalid config"):
        assert line in out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["trian", TOY])
    assert info.value.code == 2


def test_check_env_runs_and_prints_a_verdict():
    result = subprocess.run([sys.executable, "-m", "raygraph.cli", "check-env"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode in (0, 1), result.stderr
    last = [line for line in result.stdout.splitlines() if line.startswith("verdict: ")]
    assert last and (last[0] == "verdict: OK" or last[0].startswith("verdict: PROBLEMS ("))
    assert (result.returncode == 0) == (last[0] == "verdict: OK")
    for name in ("python", "torch", "ray", "transformers", "pyarrow", "mlflow", "pydantic", "vllm", "flash-attn"):
        assert f"  {name} " in result.stdout
    assert "layerwise weight reload into a running engine" in result.stdout


def test_check_env_counts_problems(monkeypatch):
    R = check_env_module.Requirement
    monkeypatch.setattr(check_env_module, "REQUIREMENTS", (
        R("pytest", "999", "needs the future"),                           # installed but too old
        R("no-such-package-raygraph", "1", "a required package"),         # missing
        R("no-such-gpu-package-raygraph", "1", "GPU only", gpu_only=True),  # missing but optional
        R("pytest", "1", "a range", below="2"),                            # newer than supported
    ))
    out = io.StringIO()
    assert check_env_module.check_env(out=out) == 1
    text = out.getvalue()
    assert "verdict: PROBLEMS (3)" in text
    assert "pytest" in text and "is older than 999: needs the future" in text
    assert "is newer than the supported range >=1,<2: a range" in text
    assert "no-such-package-raygraph is not installed (need >= 1: a required package)" in text
    assert "no-such-gpu-package-raygraph is not installed" not in text


def test_train_checks_the_config_before_anything(capsys):
    assert main(["train", TOY, "actor.lr=1"]) == 2
    assert "did you mean actor.optim.lr?" in capsys.readouterr().err


def test_data_toy(tmp_path, capsys):
    code = main(["data", "toy", "--out", str(tmp_path), "--n-train", "8", "--n-val", "4", "--seed", "1"])
    assert code == 0
    written = sorted(p.name for p in tmp_path.glob("*.parquet"))
    assert written == ["train.parquet", "train_dpo.parquet", "val.parquet", "warm_start.parquet"]
    from raygraph.data import PromptDataset
    from raygraph.models.tiny import build_tiny_tokenizer

    train = PromptDataset(tmp_path / "train.parquet", build_tiny_tokenizer(), max_prompt_length=32)
    assert len(train) == 8 and train[0].data_source == "toy_arith"


def test_data_word_problems_writes_the_splits(tmp_path, capsys):
    import pyarrow.parquet as pq

    from raygraph.data.word_problems import DATA_SOURCE, word_problems

    out = tmp_path / "wp"
    assert main(["data", "word-problems", "--out", str(out), "--n-train", "6", "--n-val", "3", "--seed", "2"]) == 0
    assert capsys.readouterr().out == f"wrote {out / 'train.parquet'} (6 rows) and {out / 'val.parquet'} (3 rows)\n"
    assert sorted(p.name for p in out.iterdir()) == ["train.parquet", "val.parquet"]
    train, val = (pq.read_table(out / f"{name}.parquet").to_pylist() for name in ("train", "val"))
    assert [(r["prompt"][1]["content"], r["reward_model"]["ground_truth"]) for r in val] == word_problems(3, seed=2)
    assert len(train) == 6 and {r["data_source"] for r in train + val} == {DATA_SOURCE}
    assert not {r["prompt"][1]["content"] for r in train} & {r["prompt"][1]["content"] for r in val}


def test_data_gsm8k_missing_input(tmp_path, capsys):
    assert main(["data", "gsm8k", "--input", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_names_a_tokenizer_without_chat_template_and_the_fix(tmp_path, capsys):
    from raygraph.models.tiny import build_tiny_lm

    model = build_tiny_lm(tmp_path / "base-model")
    (model / "chat_template.jinja").unlink()   # a base model: no chat template
    code = main(["train", TOY, f"model.path={model}", "model.tiny=null",
                 f"trainer.output_dir={tmp_path / 'runs'}", "logging.mlflow=false",
                 f"data.train_files=[{tmp_path / 'toy' / 'train.parquet'}]",
                 f"data.val_files=[{tmp_path / 'toy' / 'val.parquet'}]"])
    err = capsys.readouterr().err
    assert code == 2, err   # BadData: fix the input and rerun
    assert f"the tokenizer at {model} has no chat template" in err and "data.apply_chat_template=false" in err
    assert "Traceback" not in err


def test_a_raygraph_error_is_one_line_and_raygraph_debug_shows_its_traceback(monkeypatch, capsys):
    import traceback

    from raygraph.run import checkpoint, trainer

    def failing_run(cfg, address=None):
        raise checkpoint.CheckpointError("checkpoint runs/x/step_3 has no MANIFEST.json")

    monkeypatch.setattr(trainer, "run", failing_run)
    monkeypatch.delenv("RAYGRAPH_DEBUG", raising=False)
    assert main(["train", TOY]) == 1   # a checkpoint error: the run failed
    assert capsys.readouterr().err == ("raygraph train: CheckpointError: checkpoint runs/x/step_3 has no "
                                       "MANIFEST.json\n")
    monkeypatch.setenv("RAYGRAPH_DEBUG", "1")
    with pytest.raises(checkpoint.CheckpointError) as info:   # raised on: the interpreter prints its traceback
        main(["train", TOY])
    shown = "".join(traceback.format_exception(info.value))
    assert shown.startswith("Traceback (most recent call last):") and "in failing_run" in shown


def test_the_demo_trains_from_another_folder_into_another_output_folder(tmp_path, monkeypatch, ray_local,
                                                                       capsys):
    # before: "model.path runs/models/tiny-lm does not exist" with any output folder but ./runs
    from raygraph.config import load_config

    cwd, out = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code = main(["train", DEMO, f"trainer.output_dir={out}", "run_name=moved", "trainer.total_steps=1",
                 "trainer.warm_start.steps=2", "data.val_prompts=8", "logging.mlflow=false"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    model = out / "models" / "tiny-tiny"
    assert f"model.tiny=tiny: building a RANDOM-INIT tiny model at {model}" in captured.out
    assert (model / "config.json").is_file() and not (cwd / "runs" / "models").exists()
    run_dir = out / "demo" / "moved"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert load_config(run_dir / "config.yaml").model.path == str(model)   # the resolved config loads back


def test_model_import_names_a_missing_or_non_gguf_file(tmp_path, capsys):
    assert main(["model", "import", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "m")]) == 1
    assert "nope.gguf" in capsys.readouterr().err
    fake = tmp_path / "weights.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    assert main(["model", "import", str(fake), "--out", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "weights.gguf" in err and "GGUF" in err and not (tmp_path / "m").exists()
