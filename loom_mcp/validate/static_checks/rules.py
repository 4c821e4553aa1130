"""The static checks as data: the names and patterns each family looks for, and the finding
(check, severity, message) each match produces. The handler modules hold only the logic.

The values are in rules.toml beside this module, read once at import. This module declares each
table's name and type (what the handlers import and mypy checks); `_bind` builds every declared
name from the file as its annotation says, and refuses a file that names more or fewer."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from importlib import resources
from typing import Any, Literal, NamedTuple, get_args

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

Severity = Literal["error", "warning"]


class Rule(NamedTuple):
    """One kind of finding; `message` is a str.format template whose fields the handler fills."""

    check: str
    severity: Severity
    message: str


# rules.toml groups these by check family, with the reasons; here they are grouped by type.

# Every check the static pass can report -> the severities it reports it at ("error/warning").
CHECKS: dict[str, str]
# Lower-precision dtypes and tensor methods -> canonical name ("fp16", "bf16", "fp8").
LOW_DTYPES: dict[str, str]
LOW_PRECISION_METHODS: dict[str, str]

# Names looked up by membership.
INTROSPECTION_CALLS: frozenset[str]
INTROSPECTION_ATTRS: frozenset[str]
GUARDED_ROOTS: frozenset[str]
SENSITIVE_ATTRS: frozenset[str]
DEFERRED_CALLS: frozenset[str]
PROCESS_CALLS: frozenset[str]
STREAM_CALLS: frozenset[str]
SUBCLASS_HOOKS: frozenset[str]
TENSOR_BASES: frozenset[str]
IO_CALLS: frozenset[str]
IO_WARNING_CALLS: frozenset[str]
PATH_IO_METHODS: frozenset[str]
SOURCE_READS: frozenset[str]
DYNAMIC_CALLS: frozenset[str]
IDENTITY_METHODS: frozenset[str]
NON_COMPUTE_TORCH: frozenset[str]
TENSOR_COMPUTE_METHODS: frozenset[str]
PRECISION_FLAGS: frozenset[str]
AUTOCAST_CALLS: frozenset[str]
SEED_CALLS: frozenset[str]

# Names kept in order, as tuples (module families, prefixes and suffixes among them).
DEFAULT_REFERENCE_NAMES: tuple[str, ...]
DEFAULT_TASK_MODULES: tuple[str, ...]
CONFIG_PREFIXES: tuple[str, ...]
THREAD_MODULES: tuple[str, ...]
PROCESS_CALL_PREFIXES: tuple[str, ...]
BENIGN_STREAM_SUFFIXES: tuple[str, ...]
DISPATCH_MODULES: tuple[str, ...]
CTYPES_MODULES: tuple[str, ...]
IO_MODULES: tuple[str, ...]
IO_WARNING_PREFIXES: tuple[str, ...]
IO_PATH_MARKERS: tuple[str, ...]
DYNAMIC_MODULES: tuple[str, ...]
IDENTITY_ATTRS: tuple[str, ...]
KEY_METHODS: tuple[str, ...]
CACHE_DECORATORS: tuple[str, ...]
KERNEL_MARKERS: tuple[str, ...]

# Inline native sources: what marks a string constant as one, and the static pointer-keyed map
# (a STATIC_MAP whose key type, within STATIC_MAP_WINDOW characters, is a POINTER_KEY_TYPE).
NATIVE_SOURCE: re.Pattern[str]
STATIC_MAP: re.Pattern[str]
POINTER_KEY_TYPE: re.Pattern[str]
STATIC_MAP_WINDOW: int

# One kind of finding each.
SYNTAX: Rule
CODING_COOKIE: Rule
REFERENCE_NAME: Rule
REFERENCE_IMPORT: Rule
RELATIVE_IMPORT: Rule
TASK_IMPORT: Rule
MAIN_IMPORT: Rule
INTROSPECTION_CALL: Rule
INTROSPECTION_ATTR: Rule
SYS_MODULES: Rule
GUARDED_STORE: Rule
SENSITIVE_STORE: Rule
MODULE_NAMESPACE_STORE: Rule
OBJECT_NAMESPACE_STORE: Rule
GUARDED_SETATTR: Rule
SENSITIVE_SETATTR: Rule
ATEN_OVERRIDE: Rule
BUILTINS_NAME: Rule
THREAD_IMPORT: Rule
PROCESS_IMPORT: Rule
PROCESS_CALL: Rule
DEFERRED_CALL: Rule
DEL_METHOD: Rule
STREAM_CALL: Rule
STREAM_ARG: Rule
DISPATCH_IMPORT: Rule
SUBCLASS_HOOK_DEF: Rule
SUBCLASS_HOOK_USE: Rule
SUBCLASS_HOOK_NAMED: Rule
TENSOR_SUBCLASS: Rule
AS_SUBCLASS: Rule
CTYPES_IMPORT: Rule
IO_IMPORT: Rule
IO_CALL: Rule
IO_WARNING_CALL: Rule
PATH_IO: Rule
OPEN_CALL: Rule
SOURCE_WRITE: Rule
TOFILE: Rule
IO_PATH: Rule
DYNAMIC_IMPORT: Rule
DYNAMIC_CALL: Rule
COMPUTED_GETATTR: Rule
POINTER_KEY: Rule
CACHED_FORWARD: Rule
HANDLER_FALLBACK: Rule
SWALLOW_AROUND_KERNEL: Rule
SWALLOW: Rule
SUPPRESS_ERRORS: Rule
PRECISION_FLAG: Rule
LOW_DTYPE: Rule
LOW_PRECISION_METHOD: Rule
MATMUL_PRECISION: Rule
AUTOCAST: Rule
TF32_ARG: Rule
SEED_CALL: Rule
NO_KERNEL: Rule
STATIC_POINTER_MAP: Rule

# Each import family: the modules and what importing one means. Bound after the tables and rules
# it pairs (rules.toml names them), since names are bound in the order declared here.
MODULE_RULES: tuple[tuple[tuple[str, ...], Rule], ...]
# Inline native source: a token's pattern and the finding it makes ({token} is what matched).
NATIVE_PATTERNS: tuple[tuple[re.Pattern[str], Rule], ...]


def _strings(raw: Any) -> list[str]:
    if not (isinstance(raw, list) and all(isinstance(item, str) for item in raw)):
        raise TypeError(f"expected an array of strings, got {raw!r}")
    return raw


def _rule(raw: Any) -> Rule:
    rule = Rule._make(_strings(raw))  # TypeError unless exactly [check, severity, message]
    if rule.severity not in get_args(Severity):
        raise TypeError(f"severity {rule.severity!r} is not one of {get_args(Severity)}")
    return rule


def _text(raw: Any) -> str:
    if not isinstance(raw, str):
        raise TypeError(f"expected a string, got {raw!r}")
    return raw


def _number(raw: Any) -> int:
    if not isinstance(raw, int):
        raise TypeError(f"expected an integer, got {raw!r}")
    return raw


def _names(raw: Any) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise TypeError(f"expected a table, got {raw!r}")
    return {_text(key): _text(value) for key, value in raw.items()}


# How each declared type is built from its TOML value; `ns` holds the names bound so far.
_BUILDERS: dict[str, Callable[[Any, dict[str, Any]], object]] = {
    "Rule": lambda raw, ns: _rule(raw),
    "frozenset[str]": lambda raw, ns: frozenset(_strings(raw)),
    "tuple[str, ...]": lambda raw, ns: tuple(_strings(raw)),
    "dict[str, str]": lambda raw, ns: _names(raw),
    "re.Pattern[str]": lambda raw, ns: re.compile(_text(raw)),
    "int": lambda raw, ns: _number(raw),
    # [[modules name, rule name], ...]: both declared (so bound) before MODULE_RULES.
    "tuple[tuple[tuple[str, ...], Rule], ...]": lambda raw, ns: tuple((ns[modules], ns[rule]) for modules, rule in raw),
    # [[...]] tables of {pattern, rule}.
    "tuple[tuple[re.Pattern[str], Rule], ...]": lambda raw, ns: tuple(
        (re.compile(_text(entry["pattern"])), _rule(entry["rule"])) for entry in raw
    ),
}


def _bind(namespace: dict[str, Any]) -> None:
    """Set every table declared above from rules.toml, in declaration order."""
    path = resources.files("loom_mcp.validate.static_checks").joinpath("rules.toml")
    found: dict[str, Any] = {}
    # The file's [sections] only group the tables; a name stands once across all of them.
    for section in tomllib.loads(path.read_text(encoding="utf-8")).values():
        for name, raw in section.items():
            if name in found:
                raise ValueError(f"rules.toml names {name} twice")
            found[name] = raw
    declared = {
        name: kind for name, kind in namespace["__annotations__"].items() if name.isupper() and not name.startswith("_")
    }
    if found.keys() != declared.keys():
        raise ValueError(f"rules.toml and rules.py disagree on {sorted(found.keys() ^ declared.keys())}")
    for name, kind in declared.items():
        try:
            namespace[name] = _BUILDERS[kind](found[name], namespace)
        except (TypeError, KeyError, re.error) as exc:
            raise ValueError(f"rules.toml: {name} is not a valid {kind}: {exc}") from exc


_bind(globals())
