"""The walk over a candidate's AST: each node goes to the check families that look at it."""

from __future__ import annotations

import ast
from collections.abc import Callable

from loom_mcp.validate.static_checks import (
    escape,
    imports,
    native,
    patching,
    precision,
    reference,
    shortcuts,
    timing,
)
from loom_mcp.validate.static_checks.context import Call, Context, is_under
from loom_mcp.validate.static_checks.rules import KERNEL_MARKERS, NO_KERNEL

# Every call goes to each family in turn.
CALL_HANDLERS: tuple[Callable[[Context, Call], None], ...] = (
    patching.check_call,
    timing.check_call,
    reference.check_call,
    escape.check_call,
    shortcuts.check_call,
    precision.check_call,
)


class Analyzer(ast.NodeVisitor):
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    # ------------------------------------------------------------ scopes

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        timing.check_function(self.ctx, node)
        shortcuts.check_function(self.ctx, node)
        for dec in node.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            if is_under(self.ctx.chain(target) or "", KERNEL_MARKERS):
                self.ctx.kernel_evidence = True
        self.ctx.functions.append(node.name)
        self.generic_visit(node)
        self.ctx.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [self.ctx.chain(base) or (base.id if isinstance(base, ast.Name) else "") for base in node.bases]
        timing.check_bases(self.ctx, node, bases)
        self.ctx.classes.append((node.name, bases))
        self.generic_visit(node)
        self.ctx.classes.pop()

    # ------------------------------------------------------------ imports

    def visit_Import(self, node: ast.Import) -> None:
        imports.check_import(self.ctx, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        imports.check_import_from(self.ctx, node)

    # ------------------------------------------------------------ names, attributes, strings

    def visit_Name(self, node: ast.Name) -> None:
        reference.check_name(self.ctx, node)
        patching.check_name(self.ctx, node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.ctx.chain(node)
        if name and is_under(name, KERNEL_MARKERS):
            self.ctx.kernel_evidence = True
        precision.check_attribute(self.ctx, node, name)
        reference.check_attribute(self.ctx, node, name)
        timing.check_attribute(self.ctx, node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        native.check_string(self.ctx, node)

    # ------------------------------------------------------------ assignments

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            patching.check_store_target(self.ctx, t, node.value, "Assigns")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        patching.check_store_target(self.ctx, node.target, node.value, "Assigns")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        patching.check_store_target(self.ctx, node.target, node.value, "Assigns")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            patching.check_store_target(self.ctx, t, None, "Deletes")
        self.generic_visit(node)

    # ------------------------------------------------------------ lookups (pointer caches)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load):
            shortcuts.check_key(self.ctx, node.slice, node)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            shortcuts.check_key(self.ctx, node.left, node)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for k in node.keys:
            if k is not None:
                shortcuts.check_key(self.ctx, k, node)
        self.generic_visit(node)

    # ------------------------------------------------------------ calls and handlers

    def visit_Call(self, node: ast.Call) -> None:
        call = self.ctx.call(node)
        if is_under(call.name, KERNEL_MARKERS):
            self.ctx.kernel_evidence = True
        for handler in CALL_HANDLERS:
            handler(self.ctx, call)
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        shortcuts.check_try(self.ctx, node)
        self.generic_visit(node)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    # ------------------------------------------------------------ finish

    def finish(self) -> None:
        if not self.ctx.kernel_evidence:
            self.ctx.report(NO_KERNEL, None)
