"""Work that escapes the timer: other streams, threads and processes, code deferred to run later,
and tensor subclasses that defer or fake the work."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, src
from loom_mcp.validate.static_checks.rules import (
    AS_SUBCLASS,
    DEFERRED_CALL,
    DEFERRED_CALLS,
    DEL_METHOD,
    PROCESS_CALL,
    PROCESS_CALL_PREFIXES,
    PROCESS_CALLS,
    STREAM_ARG,
    STREAM_CALL,
    STREAM_CALLS,
    SUBCLASS_HOOK_DEF,
    SUBCLASS_HOOK_USE,
    SUBCLASS_HOOKS,
    TENSOR_BASES,
    TENSOR_SUBCLASS,
)


def check_function(ctx: Context, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    if node.name == "__del__" and ctx.classes:
        ctx.report(DEL_METHOD, node)
    if node.name in ("__torch_function__", "__torch_dispatch__"):
        ctx.report(SUBCLASS_HOOK_DEF, node, name=node.name)


def check_bases(ctx: Context, node: ast.ClassDef, bases: list[str]) -> None:
    for base in bases:
        if base in TENSOR_BASES:
            ctx.report(TENSOR_SUBCLASS, node, name=node.name, base=base)


def check_attribute(ctx: Context, node: ast.Attribute) -> None:
    if node.attr in SUBCLASS_HOOKS:
        ctx.report(SUBCLASS_HOOK_USE, node, name=node.attr)


def check_call(ctx: Context, call: Call) -> None:
    node, name = call.node, call.name
    if name in PROCESS_CALLS or name.startswith(PROCESS_CALL_PREFIXES):
        ctx.report(PROCESS_CALL, node, name=name)
    if name in DEFERRED_CALLS:
        ctx.report(DEFERRED_CALL, node, name=name)
    if name in STREAM_CALLS:
        ctx.report(STREAM_CALL, node, name=name)
    for kw in node.keywords:
        if kw.arg == "stream" and not ctx.benign_stream(kw.value):
            value = kw.value
            # A name or attribute is suspicious when it holds a created stream; any other
            # call is, unless it is the current/default stream (checked above).
            suspicious = (
                isinstance(value, (ast.Name, ast.Attribute)) and ast.unparse(value) in ctx.stream_names
            ) or isinstance(value, ast.Call)
            if suspicious:
                ctx.report(STREAM_ARG, node, value=src(value))
    if call.attr == "as_subclass":  # _make_subclass is reported where the attribute is read
        ctx.report(AS_SUBCLASS, node)
