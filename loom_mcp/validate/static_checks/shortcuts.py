"""Skipping the work: result caches keyed by tensor identity, and except handlers that fall back
to PyTorch (or swallow the error) when a kernel fails."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, root, src
from loom_mcp.validate.static_checks.rules import (
    CACHE_DECORATORS,
    CACHED_FORWARD,
    HANDLER_FALLBACK,
    KEY_METHODS,
    NON_COMPUTE_TORCH,
    POINTER_KEY,
    SWALLOW,
    SWALLOW_AROUND_KERNEL,
    TENSOR_COMPUTE_METHODS,
)

# ------------------------------------------------------------ result caches


def check_key(ctx: Context, key: ast.AST, where: ast.AST) -> None:
    """`key` is used to look something up (subscript, `in`, dict key or dict method)."""
    if ctx.contains_identity(key):
        ctx.report(POINTER_KEY, where, key=src(key))


def check_function(ctx: Context, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    if node.name not in ("forward", "__call__"):
        return
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if ctx.chain(target) in CACHE_DECORATORS:
            ctx.report(CACHED_FORWARD, dec, name=node.name)


def check_call(ctx: Context, call: Call) -> None:
    if call.attr in KEY_METHODS and call.node.args:
        check_key(ctx, call.node.args[0], call.node)
    if call.name == "contextlib.suppress" and _broad_types(ctx, call.node.args):
        _report_swallow(ctx, call.node, "contextlib.suppress(...) of broad exceptions")


# ------------------------------------------------------------ try/except fallbacks


def check_try(ctx: Context, node: ast.Try) -> None:
    for handler in node.handlers:
        if _reraises(handler.body):
            continue
        used = _computes(ctx, handler.body)
        if used:
            ctx.report(HANDLER_FALLBACK, handler, name=used)
        elif _handler_is_broad(ctx, handler) and _has_call(node.body):
            label = "a bare except" if handler.type is None else "except " + ast.unparse(handler.type)
            _report_swallow(ctx, handler, label, node.body)


def _report_swallow(ctx: Context, node: ast.AST, what: str, body: list[ast.stmt] | None = None) -> None:
    hot = ctx.in_forward() or (body is not None and _launches_kernel(body))
    ctx.report(SWALLOW_AROUND_KERNEL if hot else SWALLOW, node, what=what)


def _broad_types(ctx: Context, types: list[ast.expr]) -> bool:
    for t in types:
        elts = t.elts if isinstance(t, ast.Tuple) else [t]
        for e in elts:
            q = ctx.chain(e) or (e.id if isinstance(e, ast.Name) else "")
            if q.removeprefix("builtins.") in ("Exception", "BaseException"):
                return True
    return False


def _handler_is_broad(ctx: Context, handler: ast.ExceptHandler) -> bool:
    return handler.type is None or _broad_types(ctx, [handler.type])


def _reraises(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Raise)


def _computes(ctx: Context, body: list[ast.stmt]) -> str | None:
    """What a handler computes with, if it computes a replacement result."""
    for stmt in body:
        for sub in ast.walk(stmt):
            if not isinstance(sub, ast.Call):
                continue
            q = ctx.chain(sub.func) or ""
            if root(q) == "torch" and q not in NON_COMPUTE_TORCH:
                return q
            f = sub.func
            if isinstance(f, ast.Name) and f.id in ctx.reference_names:
                return f.id
            if isinstance(f, ast.Attribute):
                inner = f.value
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super":
                    return f"super().{f.attr}"
                if f.attr in TENSOR_COMPUTE_METHODS and root(q) not in ("builtins", "math"):
                    return f".{f.attr}"
    return None


def _launches_kernel(body: list[ast.stmt]) -> bool:
    for stmt in body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Subscript):
                return True  # kernel[grid](...)
    return False


def _has_call(body: list[ast.stmt]) -> bool:
    only_imports = all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)
    return not only_imports and any(isinstance(sub, ast.Call) for s in body for sub in ast.walk(s))
