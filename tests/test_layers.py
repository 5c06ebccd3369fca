"""The layering rule: imports point only downward, and no module cycle exists (function-local
imports included, so none can hide a cycle).

    cli, check_env  >  run  >  config  >  workflows  >  graph  >  cluster  >  workers
                    >  models | data | rewards  >  algos  >  batch  >  errors

Modules of one layer may import each other; models, data and rewards are separate layers of the
same height that do not import one another.

Also the contract between layers that is not an import: every rollout engine in the engine table
offers what `raygraph.workers.rollout_engine.RolloutEngine` lists, with the same signatures, and
that list covers what the workflows bind on the rollout role.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {  # package (under raygraph) -> height
    "errors": -1, "batch": 0, "algos": 1, "models": 2, "data": 2, "rewards": 2, "agents": 3, "workers": 4, "cluster": 5,
    "graph": 6, "workflows": 7, "config": 8, "run": 9, "entry": 10,   # entry: cli.py, check_env.py, __init__.py
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "workflows":
        parts = ["raygraph", *parts]
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 else "__init__"
    return "entry" if layer in ("cli", "check_env", "__init__") else layer


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under `if TYPE_CHECKING:` (annotations only, never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports() -> dict[str, set[str]]:
    """Module -> the raygraph modules it imports anywhere in its body (function-local imports
    included; `if TYPE_CHECKING:` imports and a package's implicit `__init__` left out).
    `from pkg import sub` counts as importing `pkg.sub` when that is a module, else `pkg`."""
    files = [*ROOT.joinpath("raygraph").rglob("*.py"), *ROOT.joinpath("workflows").rglob("*.py")]
    modules = {_module_name(f): f for f in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip, found = _type_checking_only(tree), set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
                if len(targets) < len(subs):   # names that are not modules come from the package itself
                    targets.append(node.module)
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_every_package_has_a_layer():
    assert {_layer(m) for m in _imports()} <= set(LAYERS)


def test_imports_point_only_downward():
    upward = []
    for module, targets in _imports().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not point downward:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}   # 1 = on the stack, 2 = done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_workflows_are_installed_under_raygraph_and_import_without_ray():
    code = ("import sys, raygraph.workflows.grpo, raygraph.workflows.ppo, raygraph.graph; "
            "assert 'ray' not in sys.modules, 'a workflow imported ray'; "
            "import importlib.util; assert importlib.util.find_spec('raygraph.workflows') is not None")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_top_of_the_package_holds_only_folders_and_the_entry_points():
    loose = {p.name for p in ROOT.joinpath("raygraph").glob("*.py")}
    assert loose <= {"__init__.py", "batch.py", "errors.py", "cli.py", "check_env.py"}, loose


# ------------------------------------------------------------------------------ the rollout engine contract


def _contract_errors(engine: type) -> list[str]:
    """How `engine` departs from `RolloutEngine`: a member missing or of another kind (method,
    property, staticmethod), or a method whose parameters (names, kinds, defaults) or resolved
    type hints differ."""
    from raygraph.workers.rollout_engine import RolloutEngine

    errors = []
    for name, wanted in vars(RolloutEngine).items():
        if name.startswith("_"):
            continue
        try:
            got = inspect.getattr_static(engine, name)
        except AttributeError:
            errors.append(f"{name}: missing")
            continue
        if type(got) is not type(wanted):
            errors.append(f"{name}: a {type(got).__name__}, the contract has a {type(wanted).__name__}")
            continue
        if isinstance(wanted, property):
            wanted, got = wanted.fget, got.fget
        elif isinstance(wanted, staticmethod):
            wanted, got = wanted.__func__, got.__func__
        params = [(p.name, p.kind, p.default) for p in inspect.signature(wanted).parameters.values()]
        if [(p.name, p.kind, p.default) for p in inspect.signature(got).parameters.values()] != params:
            errors.append(f"{name}{inspect.signature(got)}: the contract has {name}{inspect.signature(wanted)}")
        hints = {k: v for k, v in typing.get_type_hints(wanted).items() if k != "self"}
        if {k: v for k, v in typing.get_type_hints(got).items() if k != "self"} != hints:
            errors.append(f"{name}: type hints {typing.get_type_hints(got)}, the contract has {hints}")
    return errors


def test_every_rollout_engine_keeps_the_engine_contract_signatures_included():
    from raygraph.workers.engines import ROLLOUT_ENGINES

    assert set(ROLLOUT_ENGINES) == {"hf", "vllm"}
    broken = {name: _contract_errors(cls) for name, cls in ROLLOUT_ENGINES.items()}
    assert not any(broken.values()), broken


def test_the_contract_check_catches_a_wrong_signature_and_a_missing_method():
    from raygraph.workers.engines import ROLLOUT_ENGINES

    class Drifted:   # generate without `temperature`, no take_or_generate, weight_version a plain attribute
        lora_sync_for = ROLLOUT_ENGINES["hf"].lora_sync_for
        weight_version = 0

        def generate(self, batch, greedy: bool = False, n: int | None = None):
            return batch

    errors = "\n".join(_contract_errors(Drifted))
    assert "generate(self, batch" in errors and "take_or_generate: missing" in errors
    assert "weight_version: a int, the contract has a property" in errors


def _rollout_methods_bound() -> set[str]:
    """Method names the workflows and graph fragments bind on the rollout role
    (`<...>.rollout.bind("name" | "a" if c else "b", ...)`)."""
    files = [*ROOT.joinpath("workflows").rglob("*.py"), *ROOT.joinpath("raygraph", "graph").rglob("*.py")]
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind"
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "rollout"
                    and node.args):
                names |= {c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant)
                          and isinstance(c.value, str)}
    return names


def test_the_engine_contract_covers_every_method_the_workflows_bind_on_the_rollout():
    from raygraph.workers.rollout_engine import RolloutEngine

    bound = _rollout_methods_bound()
    assert {"generate", "take_or_generate", "prefetch_next"} <= bound   # the scan sees them
    assert bound <= set(vars(RolloutEngine)), sorted(bound - set(vars(RolloutEngine)))


# ------------------------------------------------------------------------------ one table of role kinds


def _role_lists(source: str, label: str, names: set[str]) -> list[str]:
    """Tuple, list and set literals in `source` holding two or more role-kind names: a role list."""
    found = []
    for node in ast.walk(ast.parse(source, label)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            listed = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names}
            if len(listed) >= 2:
                found.append(f"{label}:{node.lineno}: {sorted(listed)}")
    return found


def _role_kind_names() -> set[str]:
    from raygraph.config.role_kinds import ROLE_KINDS

    return {kind.name for kind in ROLE_KINDS}


def test_no_module_but_the_role_table_lists_roles():
    """Which roles exist, which are trained, restart alone or run by default is read from
    `raygraph.config.role_kinds`; a tuple of role names anywhere else is a second table that a
    new kind would have to be added to (the role-keyed worker and argument tables are held to
    the kinds by tests/run/test_role_kinds.py)."""
    table = ROOT / "raygraph" / "config" / "role_kinds.py"
    found = [hit for path in sorted(ROOT.joinpath("raygraph").rglob("*.py")) if path != table
             for hit in _role_lists(path.read_text(), str(path.relative_to(ROOT)), _role_kind_names())]
    assert not found, "role lists outside raygraph/config/role_kinds.py:\n" + "\n".join(found)


def test_the_role_list_check_flags_the_lists_it_replaced():
    names = _role_kind_names()
    assert _role_lists('_TRAINED_ROLES = ("policy", "critic")', "m.py", names) == ["m.py:1: ['critic', 'policy']"]
    assert _role_lists('for r in ["rollout", "reward", "reference"]: pass', "m.py", names)
    assert not _role_lists('PAIR = "policy"\nif role == "rollout": pass', "m.py", names)   # one name: a use
