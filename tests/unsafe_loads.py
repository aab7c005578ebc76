"""Find Python source that unpickles, or could: an AST walk that follows imports.

Every name is resolved to what it is bound to (``import pickle as pk``, ``from pickle import
loads as l``, ``from torch.distributed import checkpoint as dcp``, relative imports, ``x = y``
aliases, ``getattr(m, "name")``, ``importlib.import_module("m")`` / ``__import__("m")``) and
each use of a qualified name is judged, called or not (``f = pickle.loads`` is a use):

- never: ``pickle`` / ``dill`` / ``cloudpickle`` loads and ``Unpickler``, ``joblib.load``,
  ``shelve``, ``marshal`` loads, ``pandas.read_pickle``, ``torch.jit.load``, ``torch.hub.load``,
  ``torch.package``'s importer, DCP's pickling readers (``FileSystemReader``, ``FsspecReader``)
  and its ``torch.save`` converters; an unpickling module handed on as a value, or ``*``-imported;
- only with a literal: ``torch.load`` with ``weights_only=True``, ``numpy.load`` without
  ``allow_pickle`` (or ``allow_pickle=False``);
- only with the project's safe pair: a DCP load with ``storage_reader=`` and
  ``planner=SafeLoadPlanner()`` (without them DCP reads ``.metadata`` with ``pickle.load`` and
  other values with ``torch.load(weights_only=False)``).

Exempt by qualified name: the one restricted unpickler subclasses ``pickle.Unpickler`` and the
safe reader subclasses ``FileSystemReader``, both in ``fsdp2lab.runtime.torch_compat``; nothing
else may subclass either, nor the restricted unpickler (its ``find_class`` could be replaced);
the safe reader's subclasses inherit its ``read_metadata`` (one that reads ``.metadata`` another
way needs a name flagged here, ``super(SafeFileSystemReader, self)`` included). Annotations are not uses (never evaluated). Out of reach: ``getattr``
with a computed name on a module not listed above, and code in strings (``exec``, ``eval``).
Not judged: ``torch.distributed``'s object collectives, which pickle between the ranks of one job
(never a file).
"""

from __future__ import annotations

import ast
from pathlib import Path

COMPAT = "fsdp2lab.runtime.torch_compat"
RESTRICTED_UNPICKLER = f"{COMPAT}._MetadataUnpickler"
SAFE_READER = f"{COMPAT}.SafeFileSystemReader"
SAFE_PLANNER = f"{COMPAT}.SafeLoadPlanner"

_DCP = "torch.distributed.checkpoint"
_UNPICKLERS = {
    f"{module}.{name}"
    for module in ("pickle", "_pickle", "cPickle", "dill", "cloudpickle")
    for name in ("load", "loads", "_load", "_loads", "Unpickler", "_Unpickler")
}
_PICKLING_READERS = {
    f"{_DCP}.FileSystemReader",
    f"{_DCP}.filesystem.FileSystemReader",
    f"{_DCP}.FsspecReader",
    f"{_DCP}._fsspec_filesystem.FsspecReader",
    f"{_DCP}.format_utils.BroadcastingTorchSaveReader",
}
# name: why it is never used.
NEVER = {
    **{name: "unpickles" for name in _UNPICKLERS},
    **{name: "is a DCP reader that unpickles .metadata" for name in _PICKLING_READERS},
    "dill.load_session": "unpickles",
    "dill.load_module": "unpickles",
    "joblib.load": "unpickles",
    "shelve.open": "opens a shelf, which unpickles its values",
    "shelve.Shelf": "opens a shelf, which unpickles its values",
    "shelve.DbfilenameShelf": "opens a shelf, which unpickles its values",
    "shelve.BsdDbShelf": "opens a shelf, which unpickles its values",
    "marshal.load": "loads code objects",
    "marshal.loads": "loads code objects",
    "pandas.read_pickle": "unpickles",
    "torch.jit.load": "loads TorchScript code",
    "torch.hub.load": "runs a repository's hubconf.py",
    "torch.package.PackageImporter": "imports pickled code",
    "torch.package.package_importer.PackageImporter": "imports pickled code",
    f"{_DCP}.format_utils.dcp_to_torch_save": "reads with DCP's pickling reader",
    f"{_DCP}.format_utils.torch_save_to_dcp": "reads with torch.load(weights_only=False)",
}
# Modules whose loads cannot be followed once the module itself is handed on.
UNPICKLING_MODULES = {
    "pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal",
    "torch.package", _DCP, f"{_DCP}.state_dict_loader", f"{_DCP}.format_utils",
}  # fmt: skip
# name: (keyword, the literal that makes it safe, whether leaving it out is safe, how many
# positional arguments may come before it).
WITH_LITERAL = {
    "torch.load": ("weights_only", True, False, 3),
    "torch.serialization.load": ("weights_only", True, False, 3),
    "torch.hub.load_state_dict_from_url": ("weights_only", True, False, 6),
    "numpy.load": ("allow_pickle", False, True, 2),
    "numpy.lib.npyio.load": ("allow_pickle", False, True, 2),
    "numpy.lib.format.read_array": ("allow_pickle", False, True, 1),
}
DCP_LOADS = {
    f"{_DCP}.{name}"
    for name in (
        "load",
        "load_state_dict",
        "state_dict_loader.load",
        "state_dict_loader.load_state_dict",
        "state_dict_loader._load_state_dict",
        "format_utils._load_state_dict",
    )
}
# A class that may subclass these: exactly one each.
_SOLE_SUBCLASS = {
    **{name: RESTRICTED_UNPICKLER for name in _UNPICKLERS if name.endswith("Unpickler")},
    **{name: SAFE_READER for name in _PICKLING_READERS if name.endswith("FileSystemReader")},
}


def module_name(file: Path, root: Path) -> str:
    """``root/fsdp2lab/runtime/x.py`` -> ``fsdp2lab.runtime.x`` (a package's ``__init__``: the
    package)."""
    parts = list(file.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def check_tree(root: Path) -> list[str]:
    """Findings in every ``*.py`` under ``root`` (a ``src`` folder: module names from paths)."""
    return [
        hit
        for file in sorted(root.rglob("*.py"))
        for hit in check_source(
            file.read_text(), module_name(file, root), str(file.relative_to(root))
        )
    ]


def check_source(text: str, module: str, where: str = "<source>") -> list[str]:
    """One ``WHERE:LINE: CODE: WHY`` per unsafe use in ``text``, the source of ``module``."""
    return _Checker(ast.parse(text), module, where, is_package=where.endswith("__init__.py")).run()


class _Checker:
    def __init__(self, tree: ast.Module, module: str, where: str, is_package: bool):
        self.tree, self.module, self.where = tree, module, where
        self.package = module if is_package else module.rpartition(".")[0]
        self.parents: dict[ast.AST, ast.AST] = {}
        self.bindings: dict[str, set[str]] = {}
        self.class_names: dict[ast.ClassDef, str] = {}
        self.annotations: set[ast.AST] = set()
        self.findings: list[str] = []

    def run(self) -> list[str]:
        self._index(self.tree, self.module)
        for _ in range(3):  # ``a = b`` chains, followed a few links deep
            self._bind_assignments()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                self._star(node)
            elif isinstance(node, ast.Name | ast.Attribute | ast.Call) and self._is_use(node):
                self._judge(node)
        return self.findings

    # ------------------------------------------------------------------ what names mean
    def _index(self, node: ast.AST, scope: str) -> None:
        """Parents, imports, defined classes and functions (by qualified name), annotations."""
        for child in ast.iter_child_nodes(node):
            self.parents[child] = node
            inner = scope
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = f"{scope}.{child.name}"
                self._bind(child.name, inner)
                if isinstance(child, ast.ClassDef):
                    self.class_names[child] = inner
                else:
                    self.annotations.update(a.annotation for a in _arguments(child) if a.annotation)
                    if child.returns:
                        self.annotations.add(child.returns)
            elif isinstance(child, ast.AnnAssign):
                self.annotations.add(child.annotation)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.asname:
                        self._bind(alias.asname, alias.name)
                    else:
                        head = alias.name.partition(".")[0]
                        self._bind(head, head)
            elif isinstance(child, ast.ImportFrom):
                base = self._from_base(child)
                for alias in child.names:
                    if alias.name != "*":
                        self._bind(alias.asname or alias.name, f"{base}.{alias.name}")
            self._index(child, inner)

    def _from_base(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.package.split(".") if self.package else []
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def _bind(self, name: str, target: str) -> None:
        self.bindings.setdefault(name, set()).add(target)

    def _bind_assignments(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign | ast.NamedExpr):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        for name in self.resolve(node.value):
                            self._bind(target.id, name)

    def resolve(self, node: ast.AST) -> set[str]:
        """The qualified names ``node`` may stand for (empty: not a name that can be followed)."""
        if isinstance(node, ast.Name):
            return self.bindings.get(node.id, {node.id})
        if isinstance(node, ast.Attribute):
            return {f"{base}.{node.attr}" for base in self.resolve(node.value)}
        if isinstance(node, ast.Call) and node.args:
            first = node.args[0]
            callee = self.resolve(node.func)
            literal = _string(node.args[1]) if len(node.args) > 1 else None
            if "getattr" in callee and literal is not None:
                return {f"{base}.{literal}" for base in self.resolve(first)}
            if callee & {"__import__", "importlib.import_module"} and _string(first):
                return {_string(first)}
        return set()

    def _is_use(self, node: ast.AST) -> bool:
        """A name read as a whole: not assigned to, not part of a larger name judged on its own
        (``pickle`` in ``pickle.loads`` or in ``getattr(pickle, "loads")``), not an annotation."""
        if isinstance(getattr(node, "ctx", None), ast.Store | ast.Del):
            return False
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return False
        if (
            isinstance(parent, ast.Call)
            and node in parent.args[:1]
            and "getattr" in self.resolve(parent.func)
            and self.resolve(parent)
        ):
            return False
        while parent is not None:
            if node in self.annotations:
                return False
            node, parent = parent, self.parents.get(parent)
        return True

    # ------------------------------------------------------------------ judging a use
    def _judge(self, node: ast.AST) -> None:
        names = self.resolve(node)
        call = self.parents.get(node)
        called = call if isinstance(call, ast.Call) and call.func is node else None
        for name in sorted(names):
            if name in NEVER and not self._sole_subclass(node, name):
                self._report(node, f"{name} {NEVER[name]}")
            elif name in UNPICKLING_MODULES:
                self._report(node, f"the module {name} is handed on: its loads cannot be followed")
            elif name in WITH_LITERAL:
                self._literal_rule(node, called, name)
            elif name in DCP_LOADS:
                self._dcp_rule(node, called, name)
            elif name == RESTRICTED_UNPICKLER and self._base_of(node):
                self._report(node, f"a subclass of {name} can override its find_class")
            if name == "super" and called and called.args:
                skipped = self.resolve(called.args[0]) & {RESTRICTED_UNPICKLER, SAFE_READER}
                for what in skipped:
                    self._report(called, f"reaches past {what} to the unrestricted method")

    def _literal_rule(self, node: ast.AST, call: ast.Call | None, name: str) -> None:
        keyword, safe, absent_ok, positional = WITH_LITERAL[name]
        if call is None:
            self._report(node, f"{name} handed on: its {keyword}= cannot be checked")
            return
        given = {k.arg: k.value for k in call.keywords}
        value = given.get(keyword)
        if (
            None in given
            or len(call.args) > positional
            or any(isinstance(a, ast.Starred) for a in call.args)
        ):
            self._report(call, f"{name}: {keyword}= given by position or through * / **")
        elif value is None and not absent_ok:
            self._report(call, f"{name} without {keyword}={safe}")
        elif value is not None and not (isinstance(value, ast.Constant) and value.value is safe):
            self._report(call, f"{name} with {keyword}= not the literal {safe}")

    def _dcp_rule(self, node: ast.AST, call: ast.Call | None, name: str) -> None:
        if call is None:
            self._report(node, f"{name} handed on: its reader and planner cannot be checked")
            return
        given = {k.arg: k.value for k in call.keywords}
        reader, planner = given.get("storage_reader"), given.get("planner")
        if reader is None or (isinstance(reader, ast.Constant) and reader.value is None):
            self._report(call, f"{name} without storage_reader=: DCP's reader unpickles .metadata")
        if not (isinstance(planner, ast.Call) and self.resolve(planner.func) == {SAFE_PLANNER}):
            self._report(
                call, f"{name} without planner=SafeLoadPlanner(): DCP's planner unpickles values"
            )

    def _base_of(self, node: ast.AST) -> ast.ClassDef | None:
        parent = self.parents.get(node)
        return parent if isinstance(parent, ast.ClassDef) and node in parent.bases else None

    def _sole_subclass(self, node: ast.AST, name: str) -> bool:
        """``node`` is the base of the one class allowed to subclass ``name``."""
        cls = self._base_of(node)
        return cls is not None and self.class_names[cls] == _SOLE_SUBCLASS.get(name)

    def _star(self, node: ast.ImportFrom) -> None:
        base = self._from_base(node)
        risky = [*NEVER, *WITH_LITERAL, *DCP_LOADS, *UNPICKLING_MODULES]
        if any(name == base or name.startswith(f"{base}.") for name in risky):
            self._report(node, f"from {base} import *: what it brings in cannot be followed")

    def _report(self, node: ast.AST, why: str) -> None:
        line = f"{self.where}:{node.lineno}: {ast.unparse(node)}: {why}"
        if line not in self.findings:
            self.findings.append(line)


def _arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    a = fn.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
