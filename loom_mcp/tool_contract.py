"""What tools/list publishes, and how a call's arguments are checked before a tool runs.

Every agent pays for tools/list in context before it does any work, so the published schemas
are compact: input schemas keep descriptions, defaults and constraints but drop pydantic's
titles; output schemas type every top-level field (type, nullability, enums, required) and
publish nested objects as plain objects. The complete output schema of each tool is the
resource loom://schemas/{tool}. Results are still validated against the full pydantic model
on the server and against the published schema by clients.

Arguments: unknown ones are refused, type errors come back as [BAD_INPUT] naming the fields,
and relative paths resolve against the campaign's repository when the call names a campaign
(never against the server's working directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from loom_mcp.errors import ErrorCode, LoomError

_SCHEMA_MAPS = frozenset({"properties", "$defs", "patternProperties"})
# Keywords that only document; validation does not read them.
_INPUT_DROPS = frozenset({"title"})
_OUTPUT_DROPS = frozenset({"title", "description", "default", "examples", "additionalProperties"})

# Arguments that name files or directories, per tool. start_campaign's task is already
# documented as relative to its repo argument; analyze_trace's may also be trace ids.
PATH_ARGUMENTS: dict[str, tuple[str, ...]] = {
    "start_campaign": ("repo",),
    "compile_kernel": ("source", "task"),
    "run_validation": ("task", "candidate"),
    "benchmark": ("task", "candidate", "baseline"),
    "profile": ("task", "candidate", "script"),
    "analyze_trace": ("trace", "baseline"),
    "submit_candidate": ("task", "candidate"),
    "benchmark_command": ("cwd", "repo"),
}

# Tools whose path arguments may instead name a record by id (and take no campaign_id).
IDS_OR_PATHS = {"analyze_trace": "trace id (profile returns them)"}


def compact_schema(schema: Any, drop: frozenset[str]) -> Any:
    """`schema` without the keywords in `drop`, and `anyOf: [{type: T}, {type: null}]` written
    as `type: [T, null]` (same meaning, a third of the bytes)."""
    if isinstance(schema, list):
        return [compact_schema(item, drop) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in drop:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: compact_schema(sub, drop) for name, sub in value.items()}
        else:
            out[key] = compact_schema(value, drop)
    merged = _merged_types(out.get("anyOf"))
    if merged is not None:
        del out["anyOf"]
        out = {**merged, **out}
    return out


def _family(type_name: str) -> str:
    return "number" if type_name == "integer" else type_name


def _merged_types(options: Any) -> dict[str, Any] | None:
    """`anyOf` options that differ only by type, as one schema with a list of types, when that
    means the same: each option names one type, at most one carries other keywords (items,
    maxLength, ...), and no other option's type would also be bound by them."""
    if not isinstance(options, list) or len(options) < 2:
        return None
    if not all(isinstance(o, dict) and isinstance(o.get("type"), str) for o in options):
        return None
    if any({"enum", "const"} & o.keys() for o in options):
        return None  # the values listed would also need the other types' values
    types = [o["type"] for o in options]
    rich = [o for o in options if len(o) > 1]
    if len(set(types)) != len(types) or len(rich) > 1:
        return None
    if rich and [_family(t) for t in types].count(_family(rich[0]["type"])) > 1:
        return None
    if "integer" in types and "number" in types and not (rich and _family(rich[0]["type"]) == "number"):
        types.remove("integer")  # every integer is a number
    return {**(rich[0] if rich else {}), "type": types if len(types) > 1 else types[0]}


def published_output_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Every top-level field typed; a nested model (a $ref) published as an object."""
    compact = compact_schema(schema, _OUTPUT_DROPS)
    compact.pop("$defs", None)

    def shallow(node: Any) -> Any:
        if isinstance(node, list):
            return [shallow(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return {"type": "object"}
        out = {
            key: ({n: shallow(s) for n, s in value.items()} if key in _SCHEMA_MAPS else shallow(value))
            for key, value in node.items()
        }
        merged = _merged_types(out.get("anyOf"))
        if merged is not None:
            del out["anyOf"]
            out = {**merged, **out}
        return out

    return shallow(compact)


def _without_null_defaults(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional argument says so by not being required; `"default": null` adds nothing."""
    for prop in schema.get("properties", {}).values():
        if "default" in prop and prop["default"] is None:
            del prop["default"]
    return schema


def _strict_arguments(model: type[BaseModel]) -> type[BaseModel]:
    """The SDK's argument model for a tool, refusing arguments the tool does not take."""
    config = ConfigDict(**{**model.model_config, "extra": "forbid"})  # type: ignore[typeddict-item]
    return type(model.__name__, (model,), {"model_config": config, "__module__": model.__module__})


def tighten_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """Refuse unknown arguments and publish compact schemas for the SDK's registered `tools`;
    return each tool's full output schema (served as loom://schemas/{tool})."""
    full: dict[str, dict[str, Any]] = {}
    for tool in tools:
        strict = _strict_arguments(tool.fn_metadata.arg_model)
        tool.fn_metadata.arg_model = strict
        published = compact_schema(strict.model_json_schema(by_alias=True), _INPUT_DROPS)
        published.pop("additionalProperties", None)  # refused all the same, with their names
        tool.parameters = _without_null_defaults(published)
        tool.description = " ".join(tool.description.split())  # docstring indentation is bytes too
        schema = tool.fn_metadata.output_schema
        if schema is not None:
            full[tool.name] = schema
            tool.fn_metadata.output_schema = published_output_schema(schema)
            tool.__dict__.pop("output_schema", None)  # a cached_property on the SDK's Tool
    return full


def argument_error(tool: str, exc: ValidationError, accepted: dict[str, bool]) -> LoomError:
    """[BAD_INPUT] naming each rejected argument and what it expects (never echoing values,
    which may be large or private). `accepted` maps argument names to whether they are required."""
    problems = []
    unknown = False
    for err in exc.errors(include_url=False, include_input=False):
        field = ".".join(str(part) for part in err["loc"]) or "arguments"
        if err["type"] == "extra_forbidden":
            problems.append(f"{field}: not an argument of {tool}")
            unknown = True
        elif err["type"] == "missing":
            problems.append(f"{field}: required")
        else:
            problems.append(f"{field}: {err['msg']}")
    takes = ", ".join(f"{name}{'' if required else '?'}" for name, required in accepted.items())
    hint = f"; {tool} takes {takes} (? = optional)" if unknown or any("required" in p for p in problems) else ""
    return LoomError(ErrorCode.BAD_INPUT, f"invalid arguments: {'; '.join(problems)}{hint}")


def absolute_paths(
    tool: str,
    arguments: dict[str, Any],
    campaign_repo: Callable[[str], Path | None],
    known_id: Callable[[str], bool] = lambda _: False,
) -> dict[str, Any]:
    """`arguments` with relative paths made absolute against the campaign's repository when the
    call names a campaign_id; without one a relative path is refused. `known_id` says a value
    is an id rather than a path (analyze_trace takes either)."""
    names = [n for n in PATH_ARGUMENTS.get(tool, ()) if isinstance(arguments.get(n), str)]
    relative = [
        n
        for n in names
        if arguments[n] and not os.path.isabs(os.path.expanduser(arguments[n])) and not known_id(arguments[n])
    ]
    if not relative:
        return arguments
    campaign_id = arguments.get("campaign_id")
    if tool in IDS_OR_PATHS:
        listed = ", ".join(repr(arguments[n])[:300] for n in relative)
        raise LoomError(
            ErrorCode.NOT_FOUND, f"no {IDS_OR_PATHS[tool]} {listed}, and a file must be named by its absolute path"
        )
    if not isinstance(campaign_id, str) or not campaign_id:
        listed = ", ".join(f"{n}={arguments[n]!r}"[:300] for n in relative)
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"relative path ({listed}): give an absolute path, or pass campaign_id "
            "so that relative paths resolve against the campaign's repository",
        )
    repo = campaign_repo(campaign_id)
    if repo is None:
        raise LoomError(ErrorCode.NOT_FOUND, f"no campaign {campaign_id!r}; start_campaign first")
    return {**arguments, **{n: str(repo / arguments[n]) for n in relative}}
