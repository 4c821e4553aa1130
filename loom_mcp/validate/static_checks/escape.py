"""Reaching past the process or past these checks: files, sockets and serialized caches, and code
built or loaded at run time where these checks cannot read it."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, root
from loom_mcp.validate.static_checks.rules import (
    COMPUTED_GETATTR,
    DYNAMIC_CALL,
    DYNAMIC_CALLS,
    GUARDED_ROOTS,
    IO_CALL,
    IO_CALLS,
    IO_WARNING_CALL,
    IO_WARNING_CALLS,
    IO_WARNING_PREFIXES,
    PATH_IO,
    PATH_IO_METHODS,
    TOFILE,
)


def check_call(ctx: Context, call: Call) -> None:
    _check_io(ctx, call)
    _check_dynamic(ctx, call)


def _check_io(ctx: Context, call: Call) -> None:
    node, name, func = call.node, call.name, call.node.func
    if name in IO_CALLS:
        ctx.report(IO_CALL, node, name=name.removeprefix("builtins."))
    elif name in IO_WARNING_CALLS or name.startswith(IO_WARNING_PREFIXES):
        ctx.report(IO_WARNING_CALL, node, name=name)
    elif call.attr in PATH_IO_METHODS and isinstance(func, ast.Attribute):
        base = ctx.chain(func.value) or ""
        if base.startswith("pathlib") or (
            isinstance(func.value, ast.Call) and (ctx.chain(func.value.func) or "").startswith("pathlib")
        ):
            ctx.report(PATH_IO, node, name=call.attr)
    if call.attr == "tofile":
        ctx.report(TOFILE, node)


def _check_dynamic(ctx: Context, call: Call) -> None:
    node, name = call.node, call.name
    if name in DYNAMIC_CALLS:
        ctx.report(DYNAMIC_CALL, node, name=name.removeprefix("builtins."))
    if name == "builtins.getattr" and len(node.args) >= 2:
        base = ctx.chain(node.args[0]) or ""
        attr = node.args[1]
        if root(base) in GUARDED_ROOTS and not (isinstance(attr, ast.Constant) and isinstance(attr.value, str)):
            ctx.report(COMPUTED_GETATTR, node, name=base)
