"""Recognise secrets in trace metadata without ever repeating them.

Public traces have shipped with the recording machine's environment (access tokens among it)
in a top-level block. The analysis reports that such a block exists, how big it is and whether
anything in it looks secret; it never copies a value out.
"""

from __future__ import annotations

import re
from typing import Any

# Top-level members that PyTorch/Kineto itself writes. Anything else at the top level is a block
# someone added (a harness's `metadata`, an `environment` dump, ...).
KINETO_KEYS = frozenset(
    {
        "traceEvents",
        "schemaVersion",
        "deviceProperties",
        "distributedInfo",
        "record_shapes",
        "with_flops",
        "with_modules",
        "with_stack",
        "profile_memory",
        "cuda_runtime_version",
        "cuda_driver_version",
        "cupti_version",
        "hip_runtime_version",
        "hip_driver_version",
        "roctracer_version",
        "trace_id",
        "traceName",
        "displayTimeUnit",
        "baseTimeNanoseconds",
        "systemTraceEvents",
    }
)

SECRET_KEY_RE = re.compile(
    r"(?i)(token|secret|passw(or)?d|passwd|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"credential|auth|session[_-]?key|cookie|signature)"
)

# Shapes of real credentials. No quotes or backslashes inside any match, so the same patterns
# can be applied to raw JSON bytes and the substitution keeps the document valid.
_VALUE_PATTERNS = [
    r"hf_[A-Za-z0-9]{30,}",
    r"gh[pousr]_[A-Za-z0-9]{30,}",
    r"github_pat_[A-Za-z0-9_]{20,}",
    r"glpat-[A-Za-z0-9_\-]{20,}",
    r"sk-[A-Za-z0-9_\-]{20,}",
    r"xox[abprs]-[A-Za-z0-9\-]{10,}",
    r"AKIA[0-9A-Z]{16}",
    r"AIza[0-9A-Za-z_\-]{35}",
    r"eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{10,}",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    # HTTP credentials: "Authorization: Bearer <token>", "Basic <base64>"
    r"(?i:(?<=bearer )|(?<=bearer%20)|(?<=bearer\+))[A-Za-z0-9._~+/\-]{12,}=*",
    r"(?i:(?<=basic ))[A-Za-z0-9+/]{12,}=*",
    # NAME=value / --name=value pairs in command lines and env strings
    r"(?i:(?<=[a-z_]token=))[^\s\"\\,;']{6,}",
    r"(?i:(?<=[a-z_]secret=))[^\s\"\\,;']{6,}",
    r"(?i:(?<=password=))[^\s\"\\,;']{3,}",
    r"(?i:(?<=api_key=))[^\s\"\\,;']{6,}",
    r"(?i:(?<=--token=))[^\s\"\\,;']{6,}",
]
SECRET_VALUE_RE = re.compile("|".join(_VALUE_PATTERNS))
SECRET_VALUE_BYTES_RE = re.compile("|".join(_VALUE_PATTERNS).encode())

REDACTED = "[REDACTED]"


def looks_secret_value(s: str) -> bool:
    return SECRET_VALUE_RE.search(s) is not None


def scrub_text(s: str) -> str:
    """`s` with every secret-looking substring replaced: the scrubber's own patterns, applied to
    each string the analysis reports (names, devices, file names, messages)."""
    return SECRET_VALUE_RE.sub(REDACTED, s) if SECRET_VALUE_RE.search(s) else s


def scrub_any(v: Any) -> Any:
    """Copy of a JSON-like value with `scrub_text` applied to every string, keys included."""
    if isinstance(v, str):
        return scrub_text(v)
    if isinstance(v, dict):
        return {scrub_any(k): scrub_any(x) for k, x in v.items()}
    if isinstance(v, list):
        return [scrub_any(x) for x in v]
    if isinstance(v, tuple):
        return tuple(scrub_any(x) for x in v)
    return v


def inspect_block(value: Any) -> tuple[int, int, int]:
    """(keys, secret-looking keys, secret-looking values) anywhere inside a block."""
    keys = secret_keys = secret_values = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                keys += 1
                if isinstance(k, str) and SECRET_KEY_RE.search(k):
                    secret_keys += 1
                stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str) and looks_secret_value(v):
            secret_values += 1
    return keys, secret_keys, secret_values


def redact_value(v: Any) -> tuple[Any, int]:
    """Copy of `v` with secret-looking strings and values under secret-looking keys replaced."""
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        n = 0
        for k, x in v.items():
            if isinstance(k, str) and SECRET_KEY_RE.search(k) and isinstance(x, (str, int, float)):
                out[k] = REDACTED
                n += 1
            else:
                out[k], m = redact_value(x)
                n += m
        return out, n
    if isinstance(v, list):
        items = [redact_value(x) for x in v]
        return [x for x, _ in items], sum(m for _, m in items)
    if isinstance(v, str):
        s, m = SECRET_VALUE_RE.subn(REDACTED, v)
        return s, m
    return v, 0
