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


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the fsdp2lab modules it imports, anywhere in its code (lazy imports too)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                for alias in node.names:  # ``from fsdp2lab.parallel import pp`` imports a module
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        if path.name == "__init__.py":  # a package's own submodules are not a circle
            targets = {t for t in targets if not t.startswith(f"{name}.")}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_circle():
    graph = import_graph()
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


def test_arrows_point_down():
    """Low packages never import high ones; checkpoint/ and runtime/ never import the trainer."""
    graph = import_graph()
    high = {"fsdp2lab.cli", "fsdp2lab.bench", "fsdp2lab.plan"}
    for module, targets in graph.items():
        if module.startswith(("fsdp2lab.cli", "fsdp2lab.bench", "fsdp2lab.__main__")):
            continue
        for target in targets:
            assert not any(target.startswith(h) for h in high - {"fsdp2lab.plan"}), (module, target)
            if module.startswith(("fsdp2lab.checkpoint", "fsdp2lab.runtime")):
                # hooks and guards, never the loop that runs them
                assert target not in ("fsdp2lab.training.trainer", "fsdp2lab.training.session"), (
                    module,
                    target,
                )
            if module.startswith(("fsdp2lab.parallel", "fsdp2lab.models", "fsdp2lab.data")):
                assert not target.startswith(("fsdp2lab.training", "fsdp2lab.plan")), (
                    module,
                    target,
                )


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
