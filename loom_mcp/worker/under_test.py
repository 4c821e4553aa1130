"""Loading the code under test, shared by the workers that import it: the candidate's
(loom_mcp.worker.candidate) and a benchmark arm's, candidate or baseline (loom_mcp.worker.bench).
Both workers' guards watch this module: its globals are used after the candidate's code has run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom_mcp.worker.harness import apply_task_globals, load_module


def load_model_class(path: str | Path, name: str, class_name: str, task_globals: dict[str, Any] | None) -> Any:
    """The model class of the code under test: its file imported as module `name`, with those
    task_globals that it defines too set first (a copy of the task's code sees the same shapes)."""
    module = load_module(path, name)
    apply_task_globals(module, task_globals, strict=False)
    return getattr(module, class_name)
