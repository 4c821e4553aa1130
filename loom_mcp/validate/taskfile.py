"""Static reading of task and candidate files: AST only, because the server never imports them.

A task is KernelBench-compatible: `class Model`, `get_inputs()`, `get_init_inputs()`. loom's
optional extensions are read here too: `SHAPES` (a literal list of shape dicts; each is passed
as keyword arguments to get_inputs / get_init_inputs / flops / bytes_moved, filtered to the
parameters each accepts, exactly as the worker does), `TOLERANCE` (literal {dtype: {atol, rtol}}),
a `check(out, ref)` function, `flops(**shape)`, `bytes_moved(**shape)`, `NONDETERMINISTIC` and
`BASELINE` (a file beside the task that the benchmark times when no baseline is given);
`REFERENCE_PRECISION = "native"` (read by the reference worker) skips validation's float64
rerun of a Model that already computes in float64.

Every problem is a `LoomError(BAD_INPUT)` naming `file:line`, so the agent (or the human writing
the task) can fix it without guessing. The AST reading underneath is loom_mcp.validate.source_ast;
`task_globals` are checked in loom_mcp.validate.task_globals (re-exported here).
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.fields import empty_list, optional
from loom_mcp.judge_models import DEFAULT_TOLERANCES, GateConfig, Tolerance
from loom_mcp.validate.source_ast import (
    _assigned_value,
    _fail,
    _literal,
    _module_constants,
    _NotLiteral,
    _parse,
    _read_source,
    _top_level,
)
from loom_mcp.validate.task_globals import TaskGlobalValue as TaskGlobalValue  # re-exported
from loom_mcp.validate.task_globals import assigned_globals as assigned_globals  # re-exported
from loom_mcp.validate.task_globals import check_task_globals as check_task_globals  # re-exported
from loom_mcp.validate.task_globals import parse_task_globals as parse_task_globals  # re-exported

DEFAULT_SHAPE_NAME = "default"

_DTYPE_ALIASES = {
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
    "bool": "bool",
    "int": "int",
    "long": "int",
    "short": "int",
}


def canonical_dtype(name: str) -> str | None:
    """'torch.float32' / 'float32' / 'fp32' -> 'fp32'; every fp8 flavour -> 'fp8'; ints -> 'int'.

    None for names that are not dtypes. Matches the worker's naming of reference outputs.
    """
    key = name.strip().lower().removeprefix("torch.")
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    if key.startswith(("float8", "fp8")):
        return "fp8"
    if re.fullmatch(r"u?int\d+", key):
        return "int"
    return None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Signature(_Model):
    """Parameters of a function or method (self dropped), as far as the AST tells."""

    params: list[str] = empty_list("Positional-or-keyword, in order")
    required: list[str] = empty_list("Parameters without a default")
    kwonly: list[str] = Field(default_factory=list)
    varargs: bool = False
    varkw: bool = False
    line: int | None = None

    def accepts(self, name: str) -> bool:
        return self.varkw or name in self.params or name in self.kwonly

    @property
    def max_positional(self) -> float:
        return math.inf if self.varargs else len(self.params)

    @property
    def required_positional(self) -> int:
        return len([p for p in self.params if p in self.required])


class ShapeSpec(_Model):
    name: str
    params: dict[str, Any] = Field(description="Keyword arguments for get_inputs & co (no 'name')")
    line: int | None = None


class TaskSpec(_Model):
    path: str
    model_line: int
    model_init: Signature
    model_forward: Signature
    get_inputs: Signature
    get_init_inputs: Signature
    shapes: list[ShapeSpec] = Field(description="SHAPES, or one 'default' shape when absent")
    shapes_declared: bool = Field(description="The file defines SHAPES (loom extension)")
    tolerance: dict[str, Tolerance] | None = optional("TOLERANCE by canonical dtype, as written in the task")
    has_check: bool = False
    flops: Signature | None = None
    bytes_moved: Signature | None = None
    nondeterministic: bool = False
    baseline: str | None = optional(
        "BASELINE: a file beside the task that times the slow path when the Model "
        "is only a correctness oracle (a CPU or float64 reference)"
    )
    dtypes: list[str] = empty_list(
        "Canonical dtypes the task mentions (torch.bfloat16, 'fp16' in SHAPES, ...); "
        "a candidate using them is not downgrading precision"
    )

    @property
    def shape_names(self) -> list[str]:
        return [s.name for s in self.shapes]


class CandidateSpec(_Model):
    path: str
    model_new_line: int
    init: Signature | None = optional("None when inherited")
    forward: Signature | None = optional("None when inherited")


# ---------------------------------------------------------------- signatures


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, method: bool) -> Signature:
    a = fn.args
    positional = [p.arg for p in [*a.posonlyargs, *a.args]]
    defaults_from = len(positional) - len(a.defaults)
    required = [p for i, p in enumerate(positional) if i < defaults_from]
    if method and positional:
        positional = positional[1:]
        required = [p for p in required if p in positional]
    kwonly = [p.arg for p in a.kwonlyargs]
    required += [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]
    return Signature(
        params=positional,
        required=required,
        kwonly=kwonly,
        varargs=a.vararg is not None,
        varkw=a.kwarg is not None,
        line=getattr(fn, "lineno", None),
    )


def _method(cls: ast.ClassDef, name: str) -> Signature | None:
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return _signature(stmt, method=True)
    return None


def _class(path: str, top: dict[str, ast.stmt], name: str, missing: str) -> ast.ClassDef:
    """The top-level class `name` (Model, ModelNew); `missing` says what a file without it lacks."""
    stmt = top.get(name)
    if stmt is None:
        raise _fail(path, None, f"defines no `class {name}`; {missing}")
    if not isinstance(stmt, ast.ClassDef):
        raise _fail(path, stmt.lineno, f"`{name}` must be a class (class {name}(torch.nn.Module))")
    return stmt


def _function(path: str, top: dict[str, ast.stmt], name: str, *, required: bool) -> Signature | None:
    stmt = top.get(name)
    if stmt is None:
        if required:
            raise _fail(
                path,
                None,
                f"defines no `{name}()`; a task needs class Model, "
                "get_inputs() and get_init_inputs() (the KernelBench format)",
            )
        return None
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _signature(stmt, method=False)
    value = _assigned_value(stmt)
    if isinstance(value, ast.Lambda):
        sig = _signature(value, method=False)
        return sig.model_copy(update={"line": stmt.lineno})
    raise _fail(path, stmt.lineno, f"`{name}` must be a function (def {name}(...))")


# ---------------------------------------------------------------- SHAPES and TOLERANCE


def _read_shapes(path: str, stmt: ast.stmt, consts: dict[str, Any]) -> list[ShapeSpec]:
    value = _assigned_value(stmt)
    if value is None:
        raise _fail(path, stmt.lineno, "SHAPES must be assigned a literal list of dicts")
    if not isinstance(value, (ast.List, ast.Tuple)):
        raise _fail(
            path,
            stmt.lineno,
            "SHAPES must be a literal list of dicts (the server reads it without running the "
            "file); write the shapes out instead of computing them",
        )
    if not value.elts:
        raise _fail(path, stmt.lineno, "SHAPES is empty; list at least one shape or remove it")
    shapes: list[ShapeSpec] = []
    seen: dict[str, int] = {}
    for i, elt in enumerate(value.elts):
        line = getattr(elt, "lineno", stmt.lineno)
        try:
            item = _literal(elt, consts)
        except _NotLiteral as exc:
            raise _fail(path, getattr(exc.node, "lineno", line), f"SHAPES[{i}] is not a literal: {exc.why}") from exc
        if not isinstance(item, dict):
            raise _fail(path, line, f"SHAPES[{i}] must be a dict of keyword arguments")
        for key, val in item.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise _fail(path, line, f"SHAPES[{i}] has key {key!r}; keys must be identifiers")
            if key != "name" and not _json_scalar_or_list(val):
                raise _fail(
                    path,
                    line,
                    f"SHAPES[{i}][{key!r}] must be a number, string, bool, None or a list of those",
                )
        name = item.pop("name", f"shape{i}")
        if not isinstance(name, str) or not name.strip():
            raise _fail(path, line, f"SHAPES[{i}]['name'] must be a non-empty string")
        if name in seen:
            raise _fail(path, line, f"SHAPES[{i}] repeats the name {name!r} of SHAPES[{seen[name]}]")
        seen[name] = i
        shapes.append(ShapeSpec(name=name, params=item, line=line))
    return shapes


def _json_scalar_or_list(value: Any) -> bool:
    if isinstance(value, list):
        return all(_json_scalar_or_list(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (int, str, bool)) or value is None


def _read_tolerance(path: str, stmt: ast.stmt, consts: dict[str, Any]) -> dict[str, Tolerance]:
    value = _assigned_value(stmt)
    line = stmt.lineno
    try:
        table = _literal(value, consts) if value is not None else None
    except _NotLiteral as exc:
        raise _fail(
            path,
            getattr(exc.node, "lineno", line),
            f"TOLERANCE must be a literal dict like {{'fp32': {{'atol': 1e-4, 'rtol': 1e-4}}}}: "
            f"{exc.why} (use dtype names as strings, not torch.float32)",
        ) from exc
    if not isinstance(table, dict) or not table:
        raise _fail(path, line, "TOLERANCE must be a non-empty dict {dtype: {'atol': ..., 'rtol': ...}}")
    out: dict[str, Tolerance] = {}
    for key, tol in table.items():
        dtype = canonical_dtype(key) if isinstance(key, str) else None
        if dtype is None:
            known = ", ".join(sorted(DEFAULT_TOLERANCES))
            raise _fail(path, line, f"TOLERANCE key {key!r} is not a dtype (use one of {known})")
        if not isinstance(tol, dict) or set(tol) != {"atol", "rtol"}:
            raise _fail(path, line, f"TOLERANCE[{key!r}] must be {{'atol': x, 'rtol': y}}")
        for k in ("atol", "rtol"):
            v = tol[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < math.inf):
                raise _fail(path, line, f"TOLERANCE[{key!r}][{k!r}] must be a number >= 0")
        out[dtype] = Tolerance(atol=float(tol["atol"]), rtol=float(tol["rtol"]))
    return out


def _mentioned_dtypes(tree: ast.Module) -> list[str]:
    """Dtypes named anywhere in the task: torch.<dtype> attributes and dtype-like strings."""
    found: set[str] = set()
    for node in ast.walk(tree):
        name: str | None = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch":
                name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 24:
            name = node.value
        if name:
            dtype = canonical_dtype(name)
            # Bare "float"/"int"/"bool" strings say nothing about precision; only explicit names do.
            if dtype and name.lower() not in ("float", "int", "bool", "long", "short", "double"):
                found.add(dtype)
    return sorted(found)


def _check_shape_arguments(path: str, task: TaskSpec) -> None:
    """Every shape key must reach some function, and every required parameter must be given."""
    consumers: dict[str, Signature] = {
        "get_inputs": task.get_inputs,
        "get_init_inputs": task.get_init_inputs,
    }
    if task.flops is not None:
        consumers["flops"] = task.flops
    if task.bytes_moved is not None:
        consumers["bytes_moved"] = task.bytes_moved
    for shape in task.shapes:
        where = shape.line
        label = f"shape {shape.name!r}" if task.shapes_declared else "the task (no SHAPES)"
        for key in shape.params:
            if not any(sig.accepts(key) for sig in consumers.values()):
                names = ", ".join(f"{n}()" for n in consumers)
                raise _fail(
                    path,
                    where,
                    f"{label} passes {key}={shape.params[key]!r}, which none of {names} accepts",
                )
        for fname, sig in consumers.items():
            missing = [p for p in sig.required if p not in shape.params]
            if missing:
                raise _fail(
                    path,
                    sig.line if not task.shapes_declared else where,
                    f"{fname}() requires {', '.join(missing)}, which {label} does not provide",
                )


# ---------------------------------------------------------------- public


def parse_task_source(source: str, path: str = "task.py") -> TaskSpec:
    tree = _parse(source, path)
    top = _top_level(tree)
    model = _class(
        path,
        top,
        "Model",
        "a task needs class Model (the reference), get_inputs() and get_init_inputs() (the KernelBench format)",
    )
    forward = _method(model, "forward")
    if forward is None:
        raise _fail(path, model.lineno, "class Model defines no forward()")
    get_inputs = _function(path, top, "get_inputs", required=True)
    get_init_inputs = _function(path, top, "get_init_inputs", required=True)
    assert get_inputs is not None and get_init_inputs is not None

    consts = _module_constants(tree)
    shapes_stmt = top.get("SHAPES")
    if shapes_stmt is not None:
        shapes = _read_shapes(path, shapes_stmt, consts)
    else:
        shapes = [ShapeSpec(name=DEFAULT_SHAPE_NAME, params={}, line=None)]
    tol_stmt = top.get("TOLERANCE")
    tolerance = _read_tolerance(path, tol_stmt, consts) if tol_stmt is not None else None

    check_stmt = top.get("check")
    has_check = check_stmt is not None
    if has_check:
        sig = _function(path, top, "check", required=False)
        if sig is not None and sig.max_positional < 2:
            raise _fail(path, sig.line, "check(out, ref) must take the output and the reference")

    nondeterministic = False
    nd_stmt = top.get("NONDETERMINISTIC")
    if nd_stmt is not None:
        nd = consts.get("NONDETERMINISTIC")
        if not isinstance(nd, bool):
            raise _fail(path, nd_stmt.lineno, "NONDETERMINISTIC must be True or False")
        nondeterministic = nd

    baseline = None
    base_stmt = top.get("BASELINE")
    if base_stmt is not None:
        value = consts.get("BASELINE")
        if not isinstance(value, str) or "/" in value or "\\" in value or not value.endswith(".py"):
            raise _fail(path, base_stmt.lineno, "BASELINE must be the name of a .py file beside the task")
        baseline = value

    spec = TaskSpec(
        path=path,
        model_line=model.lineno,
        model_init=_method(model, "__init__") or Signature(line=model.lineno),
        model_forward=forward,
        get_inputs=get_inputs,
        get_init_inputs=get_init_inputs,
        shapes=shapes,
        shapes_declared=shapes_stmt is not None,
        tolerance=tolerance,
        has_check=has_check,
        flops=_function(path, top, "flops", required=False),
        bytes_moved=_function(path, top, "bytes_moved", required=False),
        nondeterministic=nondeterministic,
        baseline=baseline,
        dtypes=_mentioned_dtypes(tree),
    )
    _check_shape_arguments(path, spec)
    return spec


def read_task(path: str | Path) -> TaskSpec:
    return parse_task_source(*_read_source(path, "task"))


def parse_candidate_source(source: str, path: str = "candidate.py") -> CandidateSpec:
    tree = _parse(source, path)
    cls = _class(
        path,
        _top_level(tree),
        "ModelNew",
        "a candidate defines ModelNew with the same constructor and forward() as the task's Model",
    )
    return CandidateSpec(
        path=path,
        model_new_line=cls.lineno,
        init=_method(cls, "__init__"),
        forward=_method(cls, "forward"),
    )


def read_candidate(path: str | Path) -> CandidateSpec:
    return parse_candidate_source(*_read_source(path, "candidate"))


def check_compatible(task: TaskSpec, candidate: CandidateSpec) -> None:
    """ModelNew must be callable exactly as Model is: ModelNew(*init_inputs)(*inputs).

    Names may differ (arguments are passed positionally); counts may not. A signature that is
    inherited (not in the class body) is not checked here; the worker finds out when it runs.
    """
    pairs = (
        ("__init__", task.model_init, candidate.init),
        ("forward", task.model_forward, candidate.forward),
    )
    for name, ref, cand in pairs:
        if cand is None or ref.varargs:
            continue
        n = len(ref.params)
        if cand.max_positional < n or cand.required_positional > n:
            raise _fail(
                candidate.path,
                cand.line,
                f"ModelNew.{name}({', '.join(cand.params)}) cannot be called like "
                f"Model.{name}({', '.join(ref.params)}) ({task.path}:{ref.line})",
            )


def effective_tolerances(task: TaskSpec | None = None, config: GateConfig | None = None) -> dict[str, Tolerance]:
    """The gate's table (config or defaults) overlaid by the task's TOLERANCE."""
    table = dict((config or GateConfig()).tolerances)
    if task is not None and task.tolerance:
        table.update(task.tolerance)
    return table
