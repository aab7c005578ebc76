"""The layout's promises: no import circle, ``parallel/`` names no model, each module imports down."""

from __future__ import annotations

import ast
from pathlib import Path

import fsdp2lab
from fsdp2lab.models import MODELS

SRC = Path(fsdp2lab.__file__).parent
GENERIC = ("fsdp2lab.models.spec", "fsdp2lab.models.materialize")  # no model in them


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The packages from the bottom up: a module imports only from its own level or below, type-only
# imports (``if TYPE_CHECKING:``) included. Where a lower package needs the shape of a higher
# object (checkpoint/ of the trainer, parallel/ of the run plan) it declares a ``Protocol``.
LEVELS = [
    {"errors", "tomlio", "consent", "config"},
    {"runtime"},
    {"models"},
    {"parallel"},
    {"data"},
    {"checkpoint"},
    {"plan"},
    {"training"},
    {"bench", "scale"},
    {"cli", "__main__"},
]


def _level(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    (level,) = [i for i, names in enumerate(LEVELS) if top in names]
    return level


def imports_of(source: str, modules, type_only: bool = True) -> set[str]:
    """The fsdp2lab modules ``source`` imports anywhere in its code (lazy imports too; those
    under ``if TYPE_CHECKING:`` only with ``type_only``)."""
    targets: set[str] = set()
    tree = ast.parse(source)
    for node in ast.walk(tree) if type_only else _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # ``from fsdp2lab.parallel import pp`` imports a module
                sub = f"{node.module}.{alias.name}"
                targets.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
    return {t for t in targets if t in modules}


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph(type_only: bool = True) -> dict[str, set[str]]:
    """Module -> the fsdp2lab modules it imports."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = imports_of(path.read_text(), modules, type_only) - {name}
        if path.name == "__init__.py":  # a package's own submodules are not a circle
            targets = {t for t in targets if not t.startswith(f"{name}.")}
        graph[name] = targets
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [
        (module, target)
        for module, targets in graph.items()
        if module != "fsdp2lab"
        for target in targets
        if target != "fsdp2lab" and _level(target) > _level(module)
    ]


def test_no_import_circle():
    graph = import_graph(type_only=False)  # annotations may name each other
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_every_package_has_a_level():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()}
    tops -= {"__init__", "__pycache__", "py"}
    placed = set().union(*LEVELS)
    assert {t for t in tops if not t.endswith(".typed")} <= placed, tops - placed


def test_arrows_point_down_between_packages():
    """No module imports from a package above its own, not even for a type annotation."""
    assert not upward_imports(import_graph())


def test_the_architecture_check_sees_a_type_only_upward_import():
    """The check above can fail: checkpoint/ naming the trainer in an annotation is caught."""
    modules = {"fsdp2lab.checkpoint.state", "fsdp2lab.training.trainer"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fsdp2lab.training.trainer import Trainer\n"
    )
    graph = {"fsdp2lab.checkpoint.state": imports_of(source, modules)}
    assert upward_imports(graph) == [("fsdp2lab.checkpoint.state", "fsdp2lab.training.trainer")]
    assert imports_of(source, modules, type_only=False) == set()


def test_parallel_names_no_model():
    """``parallel/`` is generic: no model name or model module appears in it."""
    for path in (SRC / "parallel").glob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        strings = {
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        assert not strings & set(MODELS), (path.name, strings & set(MODELS))
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert all(not m.startswith("fsdp2lab.models") or m in GENERIC for m in imports), path


def test_every_rank_entry_point_exits_through_exit_process():
    """A process group that outlives ``destroy_process_group`` can abort interpreter teardown
    (``runtime.distributed.exit_process``): every script that starts one ends in exit_process."""
    root = SRC.parent.parent
    scripts = [*(root / "scripts").glob("*.py"), *(root / "tests" / "scripts").glob("*.py")]
    starts = ("init_process_group(", "distributed.init(")
    missing = [
        str(p.relative_to(root))
        for p in scripts
        if any(s in p.read_text() for s in starts) and "exit_process(" not in p.read_text()
    ]
    assert scripts and not missing, missing
