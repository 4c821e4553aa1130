"""Reading a Python file without running it: its source, its AST (a syntax error names
file:line), its last top-level binding of each name, and the values of its module-level literal
constants. What the task and candidate readers (loom_mcp.validate.taskfile) build on.

Every problem is a `LoomError(BAD_INPUT)` naming `file:line` (a missing file: NOT_FOUND).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from loom_mcp.errors import ErrorCode, LoomError


def _fail(path: str, line: int | None, message: str) -> LoomError:
    where = f"{path}:{line}" if line else path
    return LoomError(ErrorCode.BAD_INPUT, f"{where}: {message}")


def _parse(source: str, path: str) -> ast.Module:
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise _fail(path, exc.lineno, f"syntax error: {exc.msg}") from exc


def _read_source(path: str | Path, what: str) -> tuple[str, str]:
    """(the file's text, its path as text); `what` ("task", "candidate") names it in errors."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except FileNotFoundError as exc:
        raise LoomError(ErrorCode.NOT_FOUND, f"{p}: {what} file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(str(p), None, f"cannot read the {what} file: {exc}") from exc


class _NotLiteral(Exception):
    def __init__(self, node: ast.AST, why: str) -> None:
        super().__init__(why)
        self.node = node
        self.why = why


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Div: lambda a, b: a / b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
}


def _literal(node: ast.AST, consts: dict[str, Any]) -> Any:
    """Evaluate a literal with integer arithmetic and module constants (`N = 2048 * 2`).

    Nothing is executed: only constants, containers, + - * / // % ** << >>, names of constants
    evaluated the same way, and dict(...) with keyword arguments.
    """
    if isinstance(node, ast.Constant):
        if isinstance(node.value, (int, float, str, bool)) or node.value is None:
            return node.value
        raise _NotLiteral(node, f"{type(node.value).__name__} constants are not allowed")
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, consts) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[Any, Any] = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None:
                raise _NotLiteral(node, "** unpacking is not allowed")
            out[_literal(k, consts)] = _literal(v, consts)
        return out
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "dict"
        and not node.args
        and all(kw.arg for kw in node.keywords)
    ):
        return {kw.arg: _literal(kw.value, consts) for kw in node.keywords}
    if isinstance(node, ast.Name):
        if node.id in consts:
            return consts[node.id]
        raise _NotLiteral(node, f"{node.id} is not a module-level constant")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand, consts)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise _NotLiteral(node, "unary +/- needs a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a = _literal(node.left, consts)
        b = _literal(node.right, consts)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            raise _NotLiteral(node, "arithmetic needs numbers")
        # Bound exponents and shifts so a hostile file cannot make the server compute forever.
        if isinstance(node.op, ast.Pow) and abs(b) > 64:
            raise _NotLiteral(node, "exponent too large")
        if isinstance(node.op, (ast.LShift, ast.RShift)) and not (0 <= b <= 64):
            raise _NotLiteral(node, "shift out of range")
        try:
            return _BINOPS[type(node.op)](a, b)
        except (ZeroDivisionError, OverflowError) as exc:
            raise _NotLiteral(node, str(exc)) from exc
    raise _NotLiteral(node, f"{type(node).__name__} is not a literal")


def _module_constants(tree: ast.Module) -> dict[str, Any]:
    """Top-level `NAME = <literal>` assignments, in order (later ones may use earlier ones)."""
    consts: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                try:
                    consts[target.id] = _literal(stmt.value, consts)
                except _NotLiteral:
                    consts.pop(target.id, None)
    return consts


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    """Last top-level binding of each name (def, class, or assignment)."""
    found: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    found[t.id] = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt
    return found


def _assigned_value(stmt: ast.stmt) -> ast.expr | None:
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        return stmt.value
    return None
