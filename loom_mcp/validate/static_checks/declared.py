"""The sibling sources a file declares (`SOURCES = [...]`), and the paths that name one of them.

The sandbox reads SOURCES with `sandbox.sources.sources_statement` and `literal_sources` (it
checks, hashes and copies those files); these checks read it with the same functions, so the two
never disagree on what a candidate declared.

Code may read a declared source (escape.py). A path names one only when it is spelled from
`__file__` and string literals, which `SourcePaths` resolves without running anything:

    Path(__file__).with_name("gemv.cu")
    Path(__file__).parent / "gemv.cu"             Path(__file__).parent.joinpath("gemv.cu")
    os.path.join(os.path.dirname(__file__), "gemv.cu")
    HERE / "gemv.cu"                              with HERE = Path(__file__).parent, bound once

(.resolve() and .absolute() may come anywhere, str() and os.fspath() around it, and
os.path.abspath/realpath around `__file__`). Nothing else names a declared source: a computed or
formatted name, an absolute literal or `..`, `.parent` of anything but `__file__`, a name bound
more than once or not at module level, `__file__`, `Path` or `os` rebound in the file, or any
star import (it could rebind them).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable
from pathlib import PurePosixPath

from loom_mcp.sandbox.sources import literal_sources, sources_statement

# A resolved path: SELF (the file itself) or the parts of a path below the file's directory,
# () being that directory.
SELF = ("<__file__>",)
_MAX_DEPTH = 16  # names that refer to names: no honest chain is near this long
_IDENTITY_METHODS = frozenset({"resolve", "absolute"})
_IDENTITY_CALLS = frozenset({"builtins.str", "os.fspath", "os.path.abspath", "os.path.realpath"})


def relative_parts(text: str) -> tuple[str, ...] | None:
    """A literal's path parts below a directory, or None where it leaves it (absolute, `..`) or
    names nothing."""
    if not text or "\x00" in text:
        return None
    path = PurePosixPath(text)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        return None
    return path.parts


def declared_names(tree: ast.Module) -> frozenset[str]:
    """The sources the file's own SOURCES declares, normalised ("./a.cu" is "a.cu"); none where
    it has no SOURCES or a malformed one (which the sandbox refuses)."""
    stmt = sources_statement(tree)
    names = literal_sources(stmt) if stmt is not None else None
    return normalised(names or ())


def normalised(names: tuple[str, ...] | list[str] | frozenset[str]) -> frozenset[str]:
    found = set()
    for name in names:
        parts = relative_parts(name)
        if parts:
            found.add("/".join(parts))
    return frozenset(found)


def _bindings(tree: ast.Module) -> Counter[str]:
    """How many places in the file bind each name (imports, definitions, stores, deletes,
    parameters, handlers, patterns, global/nonlocal): scopes are not told apart."""
    count: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                count[alias.asname or alias.name.split(".")[0]] += 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            count[node.name] += 1
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            count[node.id] += 1
        elif isinstance(node, ast.arg):
            count[node.arg] += 1
        elif isinstance(node, ast.ExceptHandler) and node.name:
            count[node.name] += 1
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            count[node.name] += 1
        elif isinstance(node, ast.MatchMapping) and node.rest:
            count[node.rest] += 1
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            count.update(node.names)
    return count


class SourcePaths:
    """Which declared source, if any, a path expression of one file names."""

    def __init__(self, tree: ast.Module, chain: Callable[[ast.AST], str | None], declared: frozenset[str]) -> None:
        self.declared = declared
        self._chain = chain
        self._bindings = _bindings(tree)
        self._star = any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree))
        # Module-level names bound once, by a plain assignment: what they name can be followed.
        self._values: dict[str, ast.expr] = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                self._values[stmt.targets[0].id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                self._values[stmt.target.id] = stmt.value

    def source(self, node: ast.AST) -> str | None:
        """The declared source `node` names (as SOURCES spells it, normalised), or None."""
        if not self.declared or self._star:
            return None
        parts = self._resolve(node, 0)
        if not parts or parts == SELF:
            return None
        name = "/".join(parts)
        return name if name in self.declared else None

    def _callee(self, func: ast.AST) -> str:
        """The callee's dotted name where its root name is bound only by its import (or, for a
        builtin, not at all), else ''."""
        root = func
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            return ""
        name = self._chain(func) or ""
        allowed = 0 if name.startswith("builtins.") else 1
        return name if self._bindings[root.id] == allowed else ""

    def _resolve(self, node: ast.AST, depth: int) -> tuple[str, ...] | None:
        if depth > _MAX_DEPTH:
            return None
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return SELF if self._bindings["__file__"] == 0 else None
            if self._bindings[node.id] == 1 and node.id in self._values:
                return self._resolve(self._values[node.id], depth + 1)
            return None
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            return () if self._resolve(node.value, depth + 1) == SELF else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._join(self._resolve(node.left, depth + 1), [node.right])
        if isinstance(node, ast.Call):
            return self._resolve_call(node, depth)
        return None

    def _resolve_call(self, node: ast.Call, depth: int) -> tuple[str, ...] | None:
        func, args = node.func, node.args
        if any(isinstance(a, ast.Starred) for a in args) or any(k.arg is None for k in node.keywords):
            return None
        if isinstance(func, ast.Attribute) and func.attr in _IDENTITY_METHODS and not args:
            return self._resolve(func.value, depth + 1)
        if isinstance(func, ast.Attribute) and func.attr == "joinpath" and not node.keywords:
            return self._join(self._resolve(func.value, depth + 1), args)
        if isinstance(func, ast.Attribute) and func.attr == "with_name" and len(args) == 1 and not node.keywords:
            base = self._resolve(func.value, depth + 1)
            name = _literal(args[0])
            if base is None or name is None or "/" in name or relative_parts(name) != (name,):
                return None
            if base == SELF:
                return (name,)
            return (*base[:-1], name) if base else None
        name = self._callee(func)
        if node.keywords or not args:
            return None
        if name == "pathlib.Path" and len(args) == 1:
            return self._resolve(args[0], depth + 1)
        if name in _IDENTITY_CALLS and len(args) == 1:
            return self._resolve(args[0], depth + 1)
        if name == "os.path.dirname" and len(args) == 1:
            return () if self._resolve(args[0], depth + 1) == SELF else None
        if name == "os.path.join":
            return self._join(self._resolve(args[0], depth + 1), args[1:])
        return None

    @staticmethod
    def _join(base: tuple[str, ...] | None, literals: list[ast.expr]) -> tuple[str, ...] | None:
        """`base` / each literal, below the file's directory only."""
        if base is None or base == SELF or not literals:
            return None
        parts = list(base)
        for node in literals:
            text = _literal(node)
            more = relative_parts(text) if text is not None else None
            if more is None:
                return None
            parts.extend(more)
        return tuple(parts)


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
