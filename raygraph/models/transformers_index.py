"""transformers' index of its model files, built once per install instead of once per process.

`import transformers` (and again its `transformers.models` package) builds an index of what each of
its ~1,100 model files exports, by reading the text of every file: ~0.5 CPU-s in every process
that imports transformers (each actor, the driver, each CLI subprocess). The index depends only on
the installed transformers files, so the first process stores it and later ones read it back
(~2 ms). Storing an index removes those of other installs not written for 30 days.

`use_stored_index()` (called when `raygraph` is imported) wraps transformers'
`define_import_structure` as soon as its module is loaded, so the wrapper is in place before
transformers calls it. The stored index is keyed by the transformers install (size and
modification time of its `__init__.py` and `models/` folder, so an upgrade or a new model file
makes a new one) and the Python version. Every failure (an unexpected transformers, an unreadable
or unwritable cache) falls back to transformers' own scan. `RAYGRAPH_TRANSFORMERS_INDEX=0` turns it
off (e.g. when editing transformers' model files in place). Measured in docs/benchmarks.md
section 19.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import os
import sys
import tempfile
import time
from pathlib import Path

from raygraph.models import import_hooks

__all__ = ["INDEX_ENV", "index_file", "use_stored_index"]

INDEX_ENV = "RAYGRAPH_TRANSFORMERS_INDEX"
_MODULE = "transformers.utils.import_utils"
_PREFIX = "transformers-index-"   # of the stored indexes' file names
_STALE_S = 30 * 24 * 3600   # another install's index not written for 30 days is removed


def use_stored_index() -> None:
    """Make transformers read its model index from the stored copy (building it on first use)."""
    if os.environ.get(INDEX_ENV, "1") == "0":
        return
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:
        _wrap(loaded)
    else:
        import_hooks.wrap_exec(_MODULE, _exec_and_wrap)


def _exec_and_wrap(exec_module, module) -> None:
    exec_module(module)
    _wrap(module)


def index_file(transformers_dir: Path) -> Path | None:
    """Where the index of the transformers installed at `transformers_dir` is stored (None: unknown install)."""
    try:
        stats = [p.stat() for p in (transformers_dir / "__init__.py", transformers_dir / "models")]
    except OSError:
        return None
    marks = [(st.st_size, st.st_mtime_ns) for st in stats]
    key = hashlib.sha256(repr((str(transformers_dir), marks, sys.version_info[:2])).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raygraph"
    return cache / f"{_PREFIX}{key}.marshal"


def _wrap(module) -> None:
    original = getattr(module, "define_import_structure", None)
    if original is None or getattr(original, "stored_index", None) is not None:
        return
    path = index_file(Path(module.__file__).resolve().parents[1])
    if path is None:
        return
    stored = _read(path)

    @functools.wraps(original)
    def define_import_structure(module_path, prefix=None):
        key = (str(module_path), prefix)
        if key not in stored:
            stored[key] = marshal.dumps(original(module_path, prefix))
            _write(path, stored)
        return marshal.loads(stored[key])   # a fresh copy each call: transformers updates what it gets

    define_import_structure.stored_index = path
    module.define_import_structure = define_import_structure


def _read(path: Path) -> dict:
    try:
        stored = marshal.loads(path.read_bytes())   # marshal: plain data only, nothing is executed
    except (OSError, ValueError, EOFError, TypeError):   # missing or cut short: built again
        return {}
    return stored if isinstance(stored, dict) else {}


def _write(path: Path, stored: dict) -> None:
    """Write atomically (processes starting together may write at once); a read-only home skips it."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, delete=False) as tmp:
            tmp.write(marshal.dumps(stored))
        os.replace(tmp.name, path)
    except (OSError, ValueError):
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
        return
    _prune(path)


def _prune(kept: Path) -> None:
    """Remove the indexes of other installs (an old venv, an earlier transformers) not written for
    `_STALE_S`: each is ~0.3 MB, and one that is still in use is simply built again. A temporary
    file that a killed writer left (`<index name><random>`) goes the same way."""
    now = time.time()
    for other in kept.parent.glob(f"{_PREFIX}*"):
        try:
            if other != kept and now - other.stat().st_mtime > _STALE_S:
                other.unlink()
        except OSError:   # removed by another process meanwhile
            continue
