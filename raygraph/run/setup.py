"""Before the first step: the run directory, local assets, and the Ray connection."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from raygraph.config import to_yaml
from raygraph.data.tool_arith import write_tool_arith
from raygraph.data.toy import write_toy_dataset
from raygraph.data.word_problems import write_word_problems
from raygraph.errors import BadConfig, BadData, MissingInput
from raygraph.models.tiny import build_tiny_lm, built_size
from raygraph.run import resume
from raygraph.run.resume import ResumePlan, default_run_name

__all__ = ["RunContext", "prepare_run", "start_ray", "ensure_assets", "check_model_path", "quiet_progress_bars"]

log = logging.getLogger("raygraph")

# What every actor process of a run gets in its environment.
ACTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "VLLM_LOGGING_LEVEL": "WARNING",   # vLLM logs every weight reload and cache reset at INFO
}


@dataclass
class RunContext:
    cfg: object
    run_dir: Path
    run_name: str
    mlflow_uri: str
    resolved: dict
    resume: ResumePlan | None = None  # the checkpoint to continue from (run/resume.py)

    @property
    def ray_name(self) -> str:
        """Prefix of actor and placement-group names: `<experiment>/<run>`."""
        return f"{self.cfg.experiment}/{self.run_name}"


def check_model_path(cfg) -> None:
    """A real model (model.tiny null) at a local-looking path that does not exist is a typo or a
    model not fetched yet: said now, before Ray starts, and never replaced by a random model."""
    path = cfg.model.path
    if cfg.model.tiny is None and _looks_local(path) and not Path(path).expanduser().exists():
        raise MissingInput(
            f"model.path {path} does not exist (working directory {Path.cwd()}). A missing model is never "
            "replaced by a random one: fix the path, or set model.tiny=<preset> (e.g. model.tiny=tiny, leaving "
            "model.path out) to train a random-init tiny model")


def _looks_local(path: str) -> bool:
    """True unless `path` could be a Hugging Face hub id (`name` or `org/name`)."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path


def _bundle_cpus(cfg) -> list[tuple[str, float]]:
    """(config key, CPUs) of every bundle size the run asks for."""
    p = cfg.placement
    if p.pools:
        return [(f"placement.pools.{name}.cpus_per_bundle", pool.cpus_per_bundle) for name, pool in p.pools.items()]
    return [("placement.cpus_per_worker", p.cpus_per_worker)]


def check_local_cpus(bundles: list[tuple[str, float]], machine_cpus: int) -> None:
    """On a local Ray, a bundle cannot use more CPUs than the machine has: each worker runs
    `cpus` torch threads (OMP_NUM_THREADS), and 64 threads on 2 cores ran 10x slower, silently.
    (On a cluster, a bundle larger than every node never gets placed: `placement_timeout_s`.)"""
    for key, cpus in bundles:
        if cpus > machine_cpus:
            raise BadConfig(f"{key}={cpus:g} is more than this machine's {machine_cpus} CPUs: on a local Ray each "
                             f"worker would run {int(cpus)} torch threads on {machine_cpus} cores, many times "
                             f"slower. Set it to at most {machine_cpus}, or join a cluster (trainer.ray_address) "
                             "whose nodes are that large")


def ensure_assets(cfg) -> None:
    """Build the tiny model and write toy data when the config asks for them and they are missing."""
    check_model_path(cfg)
    if cfg.model.tiny is not None:
        _ensure_tiny_model(cfg.model.tiny, Path(cfg.model.path), cfg.trainer.seed)
    toy = cfg.data.toy
    if toy is not None:
        _ensure_toy_data(toy, Path(cfg.data.train_files[0]).parent, [*cfg.data.train_files, *cfg.data.val_files])
    check_data_files(cfg)


def check_data_files(cfg) -> None:
    """Raise `MissingInput` naming every data file of the config that does not exist, and how to make one."""
    missing = [f for f in [*cfg.data.train_files, *cfg.data.val_files] if not Path(f).is_file()]
    if missing:
        raise MissingInput(f"data files not found: {', '.join(missing)} (make them with `raygraph data toy|"
                           "word-problems --out DIR`, or convert GSM8K with `raygraph data gsm8k --input FILE --out DIR`)")


def _ensure_tiny_model(preset: str, path: Path, seed: int) -> None:
    """Build the random-init tiny model `preset` at `path` (`model.tiny`), or reuse the one there."""
    existing = built_size(path)
    if existing is None:
        print(f"[raygraph] model.tiny={preset}: building a RANDOM-INIT tiny model at {path}; this run does "
              "not train a pretrained model", flush=True)
        building = path.with_name(f".{path.name}.building-{os.getpid()}")   # whole or absent: runs may share it
        build_tiny_lm(building, size=preset, seed=seed)
        try:
            building.rename(path)
        except OSError:   # another run built it meanwhile: theirs is the same preset
            shutil.rmtree(building, ignore_errors=True)
    elif existing != preset:
        raise BadData(f"{path} holds a tiny model of size {existing!r}, not model.tiny={preset!r}: delete "
                         "that directory to build it again")
    else:
        print(f"[raygraph] model.tiny={preset}: using the RANDOM-INIT tiny model at {path}", flush=True)


def _ensure_toy_data(toy, out_dir: Path, files: list[str]) -> None:
    """Write the toy data (data.toy) unless its files exist; files written with other data.toy
    settings (another config sharing the folder) are refused, never used in their place.
    `toy.json` in the folder records the settings they were written with."""
    stamp, wanted = out_dir / "toy.json", toy.model_dump(mode="json")
    if all(Path(f).is_file() for f in files):
        written = json.loads(stamp.read_text()) if stamp.is_file() else None
        if written is not None and written != wanted:
            raise BadData(f"{out_dir} holds toy data written with data.toy={written}, not this config's "
                             f"data.toy={wanted}: point data.train_files/val_files at another folder, or "
                             f"delete {out_dir} to write it again")
        return
    log.info("writing toy dataset to %s", out_dir)
    if toy.task == "word_problems":
        write_word_problems(out_dir, n_train=toy.n_train, n_val=toy.n_val, seed=toy.seed)
    elif toy.task == "tool_arith":
        write_tool_arith(out_dir, n_train=toy.n_train, n_val=toy.n_val, seed=toy.seed)
    else:
        write_toy_dataset(out_dir, n_train=toy.n_train, n_val=toy.n_val, seed=toy.seed, **toy.task_args)
    stamp.write_text(json.dumps(wanted, indent=1))


def quiet_progress_bars() -> None:
    """No HF/tqdm progress bars in the driver either (unless HF_HUB_DISABLE_PROGRESS_BARS is set):
    their carriage returns clutter a job log (`ray job logs`), which is not a terminal."""
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    if "huggingface_hub" in sys.modules:  # imported before us: it has read the variable already
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()


def prepare_run(cfg) -> RunContext:
    """Create `<output_dir>/<experiment>/<run>/`, choose the checkpoint to resume (a refused
    resume stops here, before anything is written), write the resolved config, build local assets."""
    quiet_progress_bars()
    check_model_path(cfg)   # before the run directory exists: a typo leaves nothing behind
    run_name = cfg.run_name
    if run_name is None:
        run_name, source = default_run_name()
        print(f"[raygraph] run name {run_name} (from {source})", flush=True)
    run_dir = Path(cfg.trainer.output_dir) / cfg.experiment / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = resume.plan(cfg, run_dir)
    ensure_assets(cfg)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if resumed is not None:
        resume.record(run_dir, resumed)
    uri = cfg.logging.mlflow_tracking_uri
    if uri is None:
        uri = f"sqlite:///{(Path(cfg.trainer.output_dir) / 'mlflow.db').resolve()}"
    return RunContext(cfg, run_dir, run_name, uri, cfg.model_dump(mode="json"), resumed)


@contextlib.contextmanager
def inherited_env(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment for the block only: the processes of a local Ray
    started in it (its raylet, hence every worker) inherit it; the driver keeps its own."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_ray(cfg, address: str | None) -> None:
    """Join `address` / `trainer.ray_address` / `RAY_ADDRESS`, or start a local Ray instance."""
    import ray  # here, not at the top: `raygraph validate` imports this module and never Ray

    from raygraph.run.role_specs import pools_for  # imports Ray too

    if ray.is_initialized():
        return
    address = address or cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining Ray cluster at %s", address)
        # Inside `ray job submit`, Ray merges the job's runtime env with this one and refuses an
        # env var set by both: the job's value wins.
        job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
        taken = (job.get("runtime_env") or {}).get("env_vars") or {}
        runtime_env = {"env_vars": {k: v for k, v in ACTOR_ENV.items() if k not in taken}}
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    check_local_cpus(_bundle_cpus(cfg), os.cpu_count() or 1)
    # Ray starts workers at niceness 15 by default; on a busy machine the actors doing the compute
    # then lose the CPU to Ray's own daemons (measured in docs/benchmarks.md).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray prestarts idle workers for the driver's job, each polling ~0.4 CPU-s a minute while it waits
    # (docs/benchmarks.md, section 19); a run starts all its actors at once when it begins anyway.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    bundle_cpus = sum(pool.bundles * pool.cpus_per_bundle for pool in pools_for(cfg).values())
    agent = cfg.rollout.agent
    if agent is not None:   # the environment hosts' CPUs (raygraph.agents.env_hosts), per rollout rank
        bundle_cpus += agent.env_hosts * agent.env_host_cpus * cfg.placement.rollout_workers
    # Logical CPUs may exceed physical cores so that small CPU layouts fit on a laptop.
    num_cpus = max(os.cpu_count() or 1, int(bundle_cpus + 2))
    # address="local": always a fresh local instance, even if a `ray start` cluster runs here. Its
    # processes inherit ACTOR_ENV from the driver's environment rather than from a job runtime env,
    # which would start every actor through Ray's `setup_worker` (raygraph.cluster.roles.START_ENV).
    with inherited_env(ACTOR_ENV):
        context = ray.init(address="local", num_cpus=num_cpus, log_to_driver=True)
    if context.dashboard_url:
        print(f"[raygraph] Ray dashboard: http://{context.dashboard_url}", flush=True)
