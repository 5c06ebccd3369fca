"""transformers' model index is scanned once per install and read back by later processes
(raygraph.models.transformers_index)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from raygraph.models import transformers_index
from raygraph.models.transformers_index import index_file


def _fake_transformers(root: Path, scans: list) -> types.ModuleType:
    """A module shaped like transformers.utils.import_utils whose scan is counted."""
    (root / "models").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "utils").mkdir()
    module = types.ModuleType("import_utils")
    module.__file__ = str(root / "utils" / "import_utils.py")

    def define_import_structure(module_path, prefix=None):
        scans.append((module_path, prefix))
        return {frozenset(): {f"{prefix}.bert": {"BertModel"}}, frozenset({"torch"}): {"llama": {"LlamaModel"}}}

    module.define_import_structure = define_import_structure
    return module


def test_the_index_is_scanned_once_stored_and_read_back_as_a_fresh_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    scans: list = []
    first = _fake_transformers(tmp_path / "transformers", scans)
    transformers_index._wrap(first)
    got = first.define_import_structure("models", "models")
    assert got == {frozenset(): {"models.bert": {"BertModel"}}, frozenset({"torch"}): {"llama": {"LlamaModel"}}}
    got[frozenset()]["models.bert"].add("changed by the caller")   # transformers updates what it gets
    assert first.define_import_structure("models", "models")[frozenset()] == {"models.bert": {"BertModel"}}
    assert scans == [("models", "models")]
    stored = index_file(tmp_path / "transformers")
    assert stored.parent == tmp_path / "cache" / "raygraph" and stored.exists()

    # a later process (a fresh module) reads the stored index: no scan; another argument is scanned
    later = _fake_transformers(tmp_path / "transformers2", scans)
    later.__file__ = first.__file__
    transformers_index._wrap(later)
    assert later.define_import_structure("models", "models")[frozenset()] == {"models.bert": {"BertModel"}}
    assert scans == [("models", "models")]
    later.define_import_structure("models/__init__.py")
    assert scans == [("models", "models"), ("models/__init__.py", None)]

    # a damaged stored index is scanned again
    stored.write_bytes(b"\x00cut")
    again = _fake_transformers(tmp_path / "transformers3", scans)
    again.__file__ = first.__file__
    transformers_index._wrap(again)
    again.define_import_structure("models", "models")
    assert scans[-1] == ("models", "models") and len(scans) == 3


def test_storing_an_index_removes_other_installs_indexes_unwritten_for_30_days(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "raygraph"
    folder.mkdir(parents=True)
    old, recent, unrelated = (folder / "transformers-index-old.marshal", folder / "transformers-index-recent.marshal",
                              folder / "notes.txt")
    left_by_a_killed_writer = folder / "transformers-index-old.marshalk2j4x9"
    for path in (old, recent, unrelated, left_by_a_killed_writer):
        path.write_bytes(b"")
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(old, (month_ago, month_ago))
    os.utime(left_by_a_killed_writer, (month_ago, month_ago))
    os.utime(unrelated, (month_ago, month_ago))
    os.utime(recent, (time.time() - 29 * 24 * 3600,) * 2)
    module = _fake_transformers(tmp_path / "transformers", [])
    transformers_index._wrap(module)
    module.define_import_structure("models", "models")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [index_file(tmp_path / "transformers").name, recent.name, unrelated.name])


def test_a_new_model_file_or_another_install_gets_another_index(tmp_path):
    root = tmp_path / "transformers"
    _fake_transformers(root, [])
    before = index_file(root)
    os.utime(root / "models", ns=(1, 1))   # a model file added or removed changes the folder's mtime
    assert index_file(root) != before
    other = tmp_path / "other" / "transformers"
    _fake_transformers(other, [])
    assert index_file(other) != index_file(root)
    assert index_file(tmp_path / "absent") is None


_PROBE = """
import json, pathlib
import raygraph, transformers, transformers.models
from transformers.utils import import_utils
wrapped = import_utils.define_import_structure
stored = getattr(wrapped, "stored_index", None)
models = pathlib.Path(transformers.models.__file__).parent
same = wrapped.__wrapped__(models, prefix="models") == wrapped(models, prefix="models") if stored else None
print(json.dumps({"stored": str(stored) if stored else None, "same": same,
                  "probe": "ProbeOnlyInTheStoredIndex" in dir(transformers.models)}))
"""


def _probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_uses_the_stored_index_in_a_new_process(tmp_path):
    """With the real transformers: the stored index equals transformers' own scan, and a later
    process builds `transformers.models` from the stored copy (an entry planted in it shows up)."""
    import marshal

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    first = _probe(env)
    assert first["stored"] and Path(first["stored"]).exists() and first["same"] and not first["probe"]
    stored = marshal.loads(Path(first["stored"]).read_bytes())
    key = next(k for k in stored if k[1] is None and k[0].endswith("__init__.py"))   # transformers.models' own
    index = marshal.loads(stored[key])
    index[frozenset()]["probe_module"] = {"ProbeOnlyInTheStoredIndex"}
    stored[key] = marshal.dumps(index)
    Path(first["stored"]).write_bytes(marshal.dumps(stored))
    assert _probe(env)["probe"]
    assert _probe({**env, "RAYGRAPH_TRANSFORMERS_INDEX": "0"}) == {"stored": None, "same": None, "probe": False}
