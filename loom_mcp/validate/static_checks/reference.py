"""Reaching outside the candidate: using the reference implementation, or reading the grader's
frames, objects and modules."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, is_under
from loom_mcp.validate.static_checks.rules import (
    INTROSPECTION_ATTR,
    INTROSPECTION_ATTRS,
    INTROSPECTION_CALL,
    INTROSPECTION_CALLS,
    REFERENCE_NAME,
    SYS_MODULES,
)


def check_name(ctx: Context, node: ast.Name) -> None:
    if node.id in ctx.reference_names and isinstance(node.ctx, ast.Load):
        # A candidate may keep its own copy of the reference class; names inside it are its own.
        inside_copy = any(name in ctx.reference_names for name, _ in ctx.classes)
        if not inside_copy:
            ctx.report(REFERENCE_NAME, node, name=node.id)


def check_attribute(ctx: Context, node: ast.Attribute, name: str | None) -> None:
    if name and is_under(name, ("sys.modules",)):
        ctx.report(SYS_MODULES, node)
    if node.attr in INTROSPECTION_ATTRS:
        ctx.report(INTROSPECTION_ATTR, node, name=node.attr)


def check_call(ctx: Context, call: Call) -> None:
    if call.name in INTROSPECTION_CALLS or (call.name == "builtins.vars" and not call.node.args):
        ctx.report(INTROSPECTION_CALL, call.node, name=call.name.removeprefix("builtins."))
