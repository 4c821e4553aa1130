"""Typed errors with stable codes. The MCP layer turns them into ToolError("[CODE] message")."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    BAD_INPUT = "BAD_INPUT"
    NOT_FOUND = "NOT_FOUND"
    COMPILE_ERROR = "COMPILE_ERROR"
    TIMEOUT = "TIMEOUT"
    CANCELLED = "CANCELLED"
    DEVICE_BUSY = "DEVICE_BUSY"
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    TOOLCHAIN_MISSING = "TOOLCHAIN_MISSING"
    WORKER_CRASHED = "WORKER_CRASHED"
    NOT_ALLOWED = "NOT_ALLOWED"
    INTERNAL = "INTERNAL"


class LoomError(Exception):
    """An error the agent can act on. `str(err)` is "[CODE] message"."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.message}"
