"""The layering rule: imports point only downward, and no module cycle exists (function-local
imports included, so none can hide a cycle).

    cli, check_env  >  run  >  config  >  workflows  >  graph  >  cluster  >  workers
                    >  models | data | rewards  >  algos  >  batch

Modules of one layer may import each other; models, data and rewards are separate layers of the
same height that do not import one another.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {  # package (under raygraph) -> height
    "batch": 0, "algos": 1, "models": 2, "data": 2, "rewards": 2, "workers": 3, "cluster": 4, "graph": 5,
    "workflows": 6, "config": 7, "run": 8, "entry": 9,   # entry: cli.py, check_env.py, __init__.py
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
    assert loose <= {"__init__.py", "batch.py", "cli.py", "check_env.py"}, loose
