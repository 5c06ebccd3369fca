"""Import a GGUF checkpoint (llama.cpp's format) into a plain Hugging Face model directory.

Every role loads models with `from_pretrained(dir)` (see `raygraph.models.loading`), so a GGUF
file is converted once, up front, instead of teaching each role about GGUF:

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/models/smollm2-135m-instruct")

Transformers reads the file (`from_pretrained(..., gguf_file=...)`, which needs the `gguf` and
`accelerate` packages) and dequantizes every tensor to `dtype`. That model still carries the GGUF
quantization flag and `save_pretrained` refuses it, so a fresh model is built from the same config
(without the flag) and given the same state dict. The written directory is then reloaded with a
plain `from_pretrained(dir)` and its logits on a probe prompt must equal the GGUF-loaded model's
exactly; anything else is an error. The output appears atomically: it is written to a temporary
sibling directory and renamed into place, with `IMPORT_RECORD` written last inside it.

Dequantizing does not undo quantization: a Q4 file gives a float model with Q4's rounding baked in.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from raygraph.errors import DataInvalid
from raygraph.models.loading import resolve_dtype

__all__ = ["GGUF_MAGIC", "IMPORT_RECORD", "GGUFImportError", "import_gguf", "is_imported_model_dir",
           "read_gguf_summary"]

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
IMPORT_RECORD = "raygraph_import.json"  # written last: its presence means the directory is complete
_PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42"


class GGUFImportError(DataInvalid, ValueError):
    """A GGUF file that cannot be imported; the message names the file and the fix."""


def _require_packages(path: Path) -> None:
    for package, why in (("gguf", "to read GGUF files"), ("accelerate", "by transformers to load GGUF files")):
        if importlib.util.find_spec(package) is None:
            raise GGUFImportError(f"importing {path} needs the `{package}` package ({why}): pip install {package}")


def _check_is_gguf(path: Path) -> None:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise GGUFImportError(f"GGUF file {path} {what}; pass the path of a .gguf checkpoint")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
                              "pass a llama.cpp .gguf checkpoint")


def read_gguf_summary(gguf_file: str | Path) -> dict:
    """Architecture, model name and `{ggml type name: tensor count}` of a GGUF file, read from its header.

    Raises:
        GGUFImportError: the file is missing, is not GGUF, or `gguf` is not installed.
    """
    path = Path(gguf_file)
    _check_is_gguf(path)
    _require_packages(path)
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str) -> str | None:
        f = reader.fields.get(key)
        return None if f is None else bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")

    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return {"architecture": field("general.architecture"), "name": field("general.name"), "tensor_types": types,
            "tensors": {t.name: t.tensor_type.name for t in reader.tensors}}


def _check_dequantizable(path: Path, summary: dict) -> None:
    """Transformers unpacks GGUF blocks with `gguf.dequantize`; probe each ggml type on one zero block."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    unsupported = []
    for name in summary["tensor_types"]:
        qtype = GGMLQuantizationType[name]
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            unsupported.append(name)
    if unsupported:
        examples = [t for t, kind in summary["tensors"].items() if kind in unsupported][:3]
        raise GGUFImportError(
            f"{path} holds tensors of type {', '.join(unsupported)} (e.g. {', '.join(examples)}), which gguf "
            f"{_version('gguf')} cannot dequantize; re-export the model from llama.cpp as F16, Q8_0 or a K-quant, "
            "or upgrade gguf (pip install -U gguf)")


def _load_from_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    source = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    try:
        AutoConfig.from_pretrained(**source)  # fails fast on an architecture transformers does not map
    except ValueError as err:
        if "architecture" not in str(err) and "not supported" not in str(err):
            raise
        raise GGUFImportError(
            f"{path}: transformers {_version('transformers')} cannot load this GGUF architecture ({err}). "
            "Use a checkpoint of a supported architecture (llama, mistral, qwen2, qwen3, phi3, gemma2, ...), "
            "a newer transformers, or the original Hugging Face checkpoint instead of the GGUF") from err
    tokenizer = AutoTokenizer.from_pretrained(**source)
    try:
        model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype)
    except ValueError as err:
        if "Unrecognized configuration class" not in str(err):
            raise
        raise GGUFImportError(f"{path} is not a causal language model transformers can load ({err}); "
                              "raygraph imports decoder-only LMs") from err
    return model.eval(), tokenizer


def _rebuild_without_quantization(model: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a fresh model whose config has no `quantization_config` (so it can be saved)."""
    config_dict = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config = type(model.config).from_dict(config_dict)
    state = model.state_dict()
    packed = [k for k, v in state.items() if not v.is_floating_point()]
    if packed:  # a transformers that keeps GGUF blocks packed (GgufLinear) would leave integer tensors here
        raise GGUFImportError(f"transformers kept {len(packed)} GGUF tensors packed (e.g. {packed[0]}); "
                              "this importer needs them dequantized")
    fresh = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    fresh.load_state_dict(state, strict=True)
    fresh.generation_config = model.generation_config
    return fresh.eval()


def _align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Generation stops at, and pads with, what the tokenizer says (the GGUF states both); context length."""
    gen = model.generation_config
    if tokenizer.eos_token_id is not None:
        gen.eos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
    if tokenizer.pad_token_id is not None:
        gen.pad_token_id = model.config.pad_token_id = tokenizer.pad_token_id
    context = getattr(model.config, "max_position_embeddings", None)
    if context and tokenizer.model_max_length > context:  # GGUF tokenizers come back "unlimited"
        tokenizer.model_max_length = context


@torch.no_grad()
def _check_reload(out: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """The saved directory must give the GGUF-loaded model's logits exactly, through plain `from_pretrained`."""
    ids = AutoTokenizer.from_pretrained(str(out))(_PROBE_TEXT, return_tensors="pt").input_ids
    if not torch.equal(ids, tokenizer(_PROBE_TEXT, return_tensors="pt").input_ids):
        raise GGUFImportError(f"the tokenizer saved in {out} encodes differently from the GGUF's")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=model.dtype).eval()
    expected, got = model(ids).logits, reloaded(ids).logits
    if not torch.equal(expected, got):
        diff = (expected.float() - got.float()).abs().max().item()
        raise GGUFImportError(f"the model saved in {out} does not reproduce the GGUF's logits (max diff {diff:.3g})")


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def is_imported_model_dir(path: str | Path) -> bool:
    """True when `path` holds a complete model written by `import_gguf` (its record file is written last)."""
    path = Path(path)
    return (path / IMPORT_RECORD).is_file() and (path / "config.json").is_file()


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str | torch.dtype = "float32", *,
                overwrite: bool = False) -> Path:
    """Write a Hugging Face model directory (config, safetensors, tokenizer, generation config) from a GGUF file.

    Args:
        gguf_file: a llama.cpp `.gguf` checkpoint of a causal LM whose architecture transformers maps.
        out_dir: the directory to create; its parent is created if needed.
        dtype: parameter dtype of the saved weights (see `resolve_dtype`); dequantization happens in it.
        overwrite: replace an existing `out_dir` (else an existing one is an error).

    Returns:
        `out_dir`, complete: `from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)` work.

    Raises:
        GGUFImportError: missing or non-GGUF file, `gguf`/`accelerate` not installed, an architecture or a
            quantization type transformers cannot load, an existing `out_dir` without `overwrite`, or a
            saved copy that does not reproduce the GGUF model's logits.
    """
    path, out, torch_dtype = Path(gguf_file).resolve(), Path(out_dir), resolve_dtype(dtype)
    summary = read_gguf_summary(path)
    _check_dequantizable(path, summary)
    if out.exists() and not overwrite:
        raise GGUFImportError(f"{out} already exists; remove it, choose another output directory, "
                              "or pass overwrite=True (--overwrite)")
    start = time.perf_counter()
    model, tokenizer = _load_from_gguf(path, torch_dtype)
    loaded = time.perf_counter()
    model_to_save = _rebuild_without_quantization(model)
    _align_special_tokens(model_to_save, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
    try:
        model_to_save.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model_to_save  # one copy fewer in memory while the reload is checked
        _check_reload(tmp, model, tokenizer)
        record = {"source": str(path), "source_bytes": path.stat().st_size, "dtype": str(torch_dtype).split(".")[-1],
                  "architecture": summary["architecture"], "name": summary["name"],
                  "tensor_types": summary["tensor_types"],
                  "versions": {p: _version(p) for p in ("transformers", "gguf", "torch")}}
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("imported %s -> %s (%s, %s; load %.1fs, convert+save+check %.1fs)", path.name, out,
             summary["architecture"], summary["tensor_types"], loaded - start, time.perf_counter() - loaded)
    return out


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename `tmp` to `out`; an existing `out` (overwrite) is moved aside first and deleted after."""
    old = None
    if out.exists():
        if not overwrite:
            raise GGUFImportError(f"{out} appeared while importing; not replacing it")
        old = out.with_name(f".{out.name}.replaced-{tmp.name}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
