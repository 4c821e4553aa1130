"""The two field declarations most of loom's pydantic models repeat, each with the description
that says what the field means (tools/list and the output schemas publish it)."""

from __future__ import annotations

from typing import Any

from pydantic import Field


def optional(description: str) -> Any:
    """A field that is None unless known; `description` says what it holds, and what None means."""
    return Field(default=None, description=description)


def empty_list(description: str) -> Any:
    """A list field that starts empty (a fresh list for every model)."""
    return Field(default_factory=list, description=description)
