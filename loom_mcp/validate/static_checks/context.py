"""What every check family shares while one candidate is read: its imports and aliases, the
scopes being walked, and the findings so far."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable
from dataclasses import dataclass

from loom_mcp.judge_models import Finding
from loom_mcp.validate.static_checks.declared import SourcePaths
from loom_mcp.validate.static_checks.rules import (
    BENIGN_STREAM_SUFFIXES,
    IDENTITY_ATTRS,
    IDENTITY_METHODS,
    STREAM_CALLS,
    Rule,
    Severity,
)

_BUILTIN_NAMES = frozenset(dir(builtins))


def root(qualname: str) -> str:
    return qualname.split(".", 1)[0]


def is_under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def make_finding(check: str, severity: Severity, message: str, filename: str, line: int | None) -> Finding:
    return Finding(
        check=check,
        severity=severity,
        message=message,
        where=f"{filename}:{line}" if line else filename,
        line=line,
    )


@dataclass(frozen=True)
class Call:
    """A call as the families see it."""

    node: ast.Call
    name: str  # dotted name through imports and aliases; '' when the callee is not such a chain
    attr: str | None  # the method name when called as `x.attr(...)`


class Context:
    def __init__(
        self,
        tree: ast.Module,
        filename: str,
        reference_names: set[str],
        task_modules: set[str],
        allowed_dtypes: set[str],
        declared_sources: frozenset[str] = frozenset(),
    ) -> None:
        self.tree = tree
        self.filename = filename
        self.reference_names = reference_names
        self.task_modules = task_modules
        self.allowed_dtypes = allowed_dtypes
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, int | None, str]] = set()
        self.aliases: dict[str, str] = {}
        self.local_names: set[str] = set()
        # Names and attribute targets (as source text, 'self.side') bound to a stream creation.
        self.stream_names: set[str] = set()
        self.identity_names: set[str] = set()  # names bound to expressions holding data_ptr/id
        self.functions: list[str] = []
        self.classes: list[tuple[str, list[str]]] = []
        self.kernel_evidence = False
        self._collect_bindings()
        # The declared sources this file may read, and which of them a path names.
        self.sources = SourcePaths(tree, self.chain, declared_sources)

    def report(self, rule: Rule, node: ast.AST | int | None, **fields: object) -> None:
        """Record `rule` at `node` (or a line number), its message filled from `fields`."""
        line = node if isinstance(node, int) or node is None else getattr(node, "lineno", None)
        message = rule.message.format(**fields)
        # Errors are reported at every line (each must be fixed); a repeated warning once, at its
        # first line, so a bf16 kernel does not bury the result under identical notes.
        key = (rule.check, line if rule.severity == "error" else None, message)
        if key in self._seen:
            return
        self._seen.add(key)
        self.findings.append(make_finding(rule.check, rule.severity, message, self.filename, line))

    def _collect_bindings(self) -> None:
        """Imports and simple aliases (`E = torch.cuda.Event`), flow-insensitively."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.local_names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.local_names.add(node.id)
            elif isinstance(node, ast.arg):
                self.local_names.add(node.arg)
        # Attribute-chain aliases, resolved to a fixed point (chains of aliases are short).
        for _ in range(4):
            changed = False
            for node in ast.walk(self.tree):
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, (ast.Name, ast.Attribute))
                ):
                    q = self.chain(node.value)
                    name = node.targets[0].id
                    if q and self.aliases.get(name) != q and root(q) != name:
                        self.aliases[name] = q
                        changed = True
            if not changed:
                break
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                if isinstance(node.value, ast.Call):
                    q = self.chain(node.value.func) or ""
                    if q in STREAM_CALLS and not self.benign_stream(node.value):
                        self.stream_names.update(ast.unparse(t) for t in targets if isinstance(t, ast.Attribute))
                        self.stream_names.update(names)
                if not names:
                    continue
                if self.contains_identity(node.value):
                    self.identity_names.update(names)

    def chain(self, node: ast.AST) -> str | None:
        """Dotted name of a pure attribute chain rooted at an import or a builtin, else None.

        getattr(x, "lit") and vars(x) are followed, because they are the usual way to reach a
        module attribute without writing its name. `posix` (os's own implementation) is named
        os, and `os.sys` sys: the same functions under another name."""
        q = self._chain(node)
        if q is None:
            return None
        for alias, canonical in (("posix", "os"), ("nt", "os"), ("os.sys", "sys")):
            if q == alias or q.startswith(alias + "."):
                return canonical + q[len(alias) :]
        return q

    def _chain(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            if node.id in self.aliases:
                return self.aliases[node.id]
            if node.id == "__builtins__":
                return "builtins"
            if node.id in _BUILTIN_NAMES and node.id not in self.local_names:
                return f"builtins.{node.id}"
            return None
        if isinstance(node, ast.Attribute):
            base = self.chain(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call) and node.args:
            func = self.chain(node.func)
            if func == "builtins.getattr" and len(node.args) >= 2:
                base = self.chain(node.args[0])
                arg = node.args[1]
                if base and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    return f"{base}.{arg.value}"
                return f"{base}.?" if base else None
            if func == "builtins.vars":
                base = self.chain(node.args[0])
                return f"{base}.__dict__" if base else None
        return None

    def call(self, node: ast.Call) -> Call:
        func = node.func
        attr = func.attr if isinstance(func, ast.Attribute) else None
        return Call(node, self.chain(func) or "", attr)

    def contains_identity(self, node: ast.AST) -> bool:
        """Whether the expression holds a tensor's address, id or bytes (a result-cache key)."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                f = sub.func
                if isinstance(f, ast.Attribute) and f.attr in IDENTITY_METHODS:
                    return True
                if self.chain(f) == "builtins.id":
                    return True
            elif isinstance(sub, ast.Attribute) and sub.attr in IDENTITY_ATTRS:
                return True
            elif isinstance(sub, ast.Name) and sub.id in self.identity_names:
                return True
        return False

    def benign_stream(self, node: ast.AST) -> bool:
        """Whether a stream expression is (or derives from) the current or default stream."""
        if isinstance(node, ast.Constant) and node.value in (None, 0):
            return True
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in BENIGN_STREAM_SUFFIXES:
                return True
            if isinstance(sub, ast.Name) and sub.id in BENIGN_STREAM_SUFFIXES:
                return True
        return False

    def in_forward(self) -> bool:
        return any(f in ("forward", "__call__") for f in self.functions)


def src(node: ast.AST) -> str:
    """The node's source, cut to fit in a message."""
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."
