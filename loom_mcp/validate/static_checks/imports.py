"""Imports: modules a candidate has no use for, the task's own module, and the reference."""

from __future__ import annotations

import ast

from loom_mcp.validate.static_checks.context import Context, is_under, root
from loom_mcp.validate.static_checks.rules import (
    KERNEL_MARKERS,
    MAIN_IMPORT,
    MODULE_RULES,
    PROCESS_CALL_PREFIXES,
    PROCESS_CALLS,
    PROCESS_IMPORT,
    REFERENCE_IMPORT,
    RELATIVE_IMPORT,
    TASK_IMPORT,
)


def check_module(ctx: Context, module: str, node: ast.AST) -> bool:
    """Report a forbidden module; True when it was reported."""
    before = len(ctx.findings)
    for modules, rule in MODULE_RULES:
        if is_under(module, modules):
            ctx.report(rule, node, name=module)
    if module == "__main__":
        ctx.report(MAIN_IMPORT, node, name=module)
    elif root(module) in ctx.task_modules:
        ctx.report(TASK_IMPORT, node, name=module)
    return len(ctx.findings) > before


def check_import(ctx: Context, node: ast.Import) -> None:
    for a in node.names:
        check_module(ctx, a.name, node)
        if is_under(a.name, KERNEL_MARKERS):
            ctx.kernel_evidence = True


def check_import_from(ctx: Context, node: ast.ImportFrom) -> None:
    module = node.module or ""
    if node.level:
        ctx.report(RELATIVE_IMPORT, node)
    module_flagged = check_module(ctx, module, node) if module else False
    for a in node.names:
        full = f"{module}.{a.name}" if module else a.name
        if not module_flagged:
            check_module(ctx, full, node)
        if is_under(full, KERNEL_MARKERS) or is_under(module, KERNEL_MARKERS):
            ctx.kernel_evidence = True
        if a.name in ctx.reference_names and not module_flagged:
            ctx.report(REFERENCE_IMPORT, node, name=a.name, module=module or "a relative module")
        if full in PROCESS_CALLS or full.startswith(PROCESS_CALL_PREFIXES):
            ctx.report(PROCESS_IMPORT, node, name=full)
