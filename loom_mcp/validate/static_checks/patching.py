"""Monkeypatching: assigning, deleting or setattr-ing what the harness relies on (timers, syncs,
comparisons, library functions), and replacing aten operators."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Call, Context, root, src
from loom_mcp.validate.static_checks.rules import (
    ATEN_OVERRIDE,
    BUILTINS_NAME,
    CONFIG_PREFIXES,
    GUARDED_ROOTS,
    GUARDED_SETATTR,
    GUARDED_STORE,
    MODULE_NAMESPACE_STORE,
    OBJECT_NAMESPACE_STORE,
    PRECISION_FLAG,
    PRECISION_FLAGS,
    SENSITIVE_ATTRS,
    SENSITIVE_SETATTR,
    SENSITIVE_STORE,
    SUBCLASS_HOOKS,
    SUPPRESS_ERRORS,
)
from loom_mcp.validate.static_checks.shortcuts import check_key


def check_name(ctx: Context, node: ast.Name) -> None:
    if node.id == "__builtins__":
        ctx.report(BUILTINS_NAME, node)


def check_store_target(ctx: Context, target: ast.AST, value: ast.AST | None, verb: str) -> None:
    """One target of an assignment or `del` (`verb` says which)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            check_store_target(ctx, elt, None, verb)
        return
    if isinstance(target, ast.Starred):
        check_store_target(ctx, target.value, value, verb)
        return
    if isinstance(target, ast.Attribute):
        _check_attribute_store(ctx, target, value, verb)
    elif isinstance(target, ast.Subscript):
        base = ctx.chain(target.value)
        if base and (root(base) in GUARDED_ROOTS or base.endswith("__dict__")):
            ctx.report(MODULE_NAMESPACE_STORE, target, verb=verb, target=src(target))
        elif isinstance(target.value, ast.Attribute) and target.value.attr == "__dict__":
            ctx.report(OBJECT_NAMESPACE_STORE, target, verb=verb, target=src(target))
        check_key(ctx, target.slice, target)


def _check_attribute_store(ctx: Context, target: ast.Attribute, value: ast.AST | None, verb: str) -> None:
    full = ctx.chain(target)
    base = ctx.chain(target.value)
    if target.attr in PRECISION_FLAGS:
        if not (isinstance(value, ast.Constant) and value.value is False):
            ctx.report(PRECISION_FLAG, target, target=src(target))
        return
    if full and full.startswith(CONFIG_PREFIXES):
        if target.attr == "suppress_errors":
            ctx.report(SUPPRESS_ERRORS, target)
        return
    if base and root(base) in GUARDED_ROOTS:
        ctx.report(GUARDED_STORE, target, verb=verb, target=src(target), root=root(base))
        return
    if target.attr == "__file__":  # where a module's declared sources are read from (declared.py)
        ctx.report(MODULE_NAMESPACE_STORE, target, verb=verb, target=src(target))
        return
    root_is_self = isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")
    if target.attr in SENSITIVE_ATTRS and not root_is_self:
        ctx.report(SENSITIVE_STORE, target, verb=verb, target=src(target))


def check_call(ctx: Context, call: Call) -> None:
    if call.name in ("builtins.setattr", "builtins.delattr") or call.attr in (
        "__setattr__",
        "__delattr__",
    ):
        _check_setattr(ctx, call.node, call.name or f"{call.attr}")
    if call.name.startswith("torch.library.") and _overrides_aten(call.node):
        ctx.report(ATEN_OVERRIDE, call.node)


def _check_setattr(ctx: Context, node: ast.Call, how: str) -> None:
    args = list(node.args)
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__"):
        obj_node: ast.AST = func.value
        if ctx.chain(obj_node) in ("builtins.object", "builtins.type"):
            if not args:
                return
            obj_node, args = args[0], args[1:]
    elif args:
        obj_node, args = args[0], args[1:]
    else:
        return
    base = ctx.chain(obj_node)
    name = args[0] if args else None
    literal = name.value if isinstance(name, ast.Constant) else None
    how = how.removeprefix("builtins.")
    if base and root(base) in GUARDED_ROOTS:
        ctx.report(GUARDED_SETATTR, node, how=how, base=base, root=root(base))
    elif literal == "__file__":
        ctx.report(MODULE_NAMESPACE_STORE, node, verb=f"Calls {how} on", target=f"{src(obj_node)}.__file__")
    elif literal in SENSITIVE_ATTRS or literal in SUBCLASS_HOOKS:
        ctx.report(SENSITIVE_SETATTR, node, how=how, attr=literal)


def _overrides_aten(node: ast.Call) -> bool:
    for arg in [*node.args, *(kw.value for kw in node.keywords)]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if arg.value == "aten" or arg.value.startswith("aten::"):
                return True
    return False
