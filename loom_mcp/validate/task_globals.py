"""`task_globals`: module-level names of a task (KernelBench's `batch_size`, `dim`, ...) that the
workers set after importing it, checked against the task's AST here, on the server, which never
imports it.
"""

from __future__ import annotations

import ast
from typing import Any

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.validate.source_ast import _parse

TaskGlobalValue = bool | int | float | str | list[int | float]


def assigned_globals(tree: ast.Module) -> list[str]:
    """Names a task binds at module level by plain assignment (`batch_size = 16`), in order."""
    names: dict[str, None] = {}
    for stmt in tree.body:
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else ([stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        )
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name):
                    names[node.id] = None
    return list(names)


def check_task_globals(source: str, path: str, overrides: dict[str, Any] | None) -> dict[str, TaskGlobalValue]:
    """`task_globals` checked against the task: only names it assigns at module level, each a
    number, string, bool or list of numbers. The workers set them after importing the task and
    before get_init_inputs()/get_inputs() (KernelBench's read `batch_size`, `dim`, ... there)."""
    if not overrides:
        return {}
    known = assigned_globals(_parse(source, path))
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"task_globals names {', '.join(unknown)}, which {path} does not assign at "
            f"module level; it assigns: {', '.join(known) or 'nothing'}",
        )
    checked: dict[str, TaskGlobalValue] = {}
    for name, value in overrides.items():
        numbers = isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        )
        if not (isinstance(value, (bool, int, float, str)) or numbers):
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"task_globals[{name!r}] = {value!r}: a value must be a number, a string, a bool or a list of numbers",
            )
        checked[name] = value
    return dict(sorted(checked.items()))


def parse_task_globals(assignments: list[str]) -> dict[str, TaskGlobalValue]:
    """`name=value` strings (the CLI's --set): a JSON value where one parses (numbers, true,
    [1, 2]), else the text itself."""
    import json

    parsed: dict[str, TaskGlobalValue] = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise LoomError(ErrorCode.BAD_INPUT, f"--set {item!r}: expected name=value, e.g. batch_size=2")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        parsed[name.strip()] = value
    return parsed
