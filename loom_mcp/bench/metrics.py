"""The metrics of a command benchmark: reading them from a run's output, and which way is better.

Where the metrics come from (`parser`):

* ``json``: the last line of stdout that is a JSON object (a pretty-printed object starting at
  the beginning of a line also counts). Nested objects are flattened with dots: ``{"a": {"b":
  1}}`` gives metric ``a.b``. Lists are kept only to say "is a list" when one is asked for.
* ``vllm``: the JSON of ``vllm bench serve --save-result`` (also ``benchmarks/
  benchmark_serving.py``): request_throughput, output_throughput, total_token_throughput,
  {mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms, completed, failed, ... A run with failed
  requests (``failed > 0``) or none completed counts as a failed run: errors are fast, and a
  candidate that drops requests must not look like a faster one.
* ``sglang``: one line of ``python -m sglang.bench_serving`` (its ``--output-file`` is JSONL, one
  record appended per run: the last record is this run's): request_throughput,
  input_throughput, output_throughput, {mean,median,p99}_e2e_latency_ms, *_ttft_ms, *_itl_ms,
  ...; or the records of ``python -m sglang.bench_one_batch --result-filename``. One-batch
  records of several configurations are all read, their metrics prefixed by what differs
  (``bs8.median_decode_throughput``, ``bs8_in512.prefill_latency``).
* ``auto``: the json extraction, then vLLM or SGLang recognised by their keys, else plain json.
  Each arm is recognised on its own, so vLLM can be compared with SGLang (name the shared
  metrics).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from loom_mcp.errors import ErrorCode, LoomError

ParserName = Literal["auto", "json", "vllm", "sglang"]
Kind = Literal["json", "vllm", "sglang"]

MAX_METRICS = 20
MAX_DEFAULT_METRICS = 8
_MAX_JSON_STARTS = 200  # lines tried as the start of a pretty-printed object, from the end

# ---------------------------------------------------------------- metric names and direction

# Exact names whose direction is known (vLLM serve, SGLang bench_serving / bench_one_batch).
_HIGHER = frozenset(
    {
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "input_throughput",
        "total_throughput",
        "output_throughput_retokenized",
        "total_throughput_retokenized",
        "max_output_tokens_per_s",
        "prefill_throughput",
        "median_decode_throughput",
        "overall_throughput",
        "accept_length",
    }
)
_LOWER = frozenset({"duration", "failed", "prefill_latency", "median_decode_latency"})
# Judged on whole tokens where a substring would misfire ("rps" in "num_warps").
_HIGHER_SUBSTRINGS = ("throughput", "goodput", "bandwidth", "speedup", "accuracy", "flops")
_HIGHER_TOKENS = frozenset({"tps", "qps", "rps", "gbps", "tbps", "toks"})
_HIGHER_SUFFIXES = ("_per_s", "_per_sec", "_per_second", "/s", "tok_s", "tokens_s")
_LOWER_SUFFIXES = ("_ms", "_us", "_ns", "_s", "_sec", "_secs", "_seconds")
_LOWER_SUBSTRINGS = ("latency", "duration", "elapsed")
_LOWER_TOKENS = frozenset({"ttft", "tpot", "itl", "e2el", "time", "runtime", "wall"})

# Headline metrics picked when `metrics` is None, in the order they are reported. One run's
# throughputs share its duration (request, output and total throughput move together for a fixed
# workload), so two are enough; latencies get a median and a tail. ~460 bytes per metric.
_DEFAULTS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "output_throughput",
        "total_token_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "median_e2el_ms",
    ),
    "sglang": (
        "output_throughput",
        "input_throughput",
        "median_e2e_latency_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        # bench_one_batch
        "median_decode_throughput",
        "prefill_throughput",
        "median_decode_latency",
        "prefill_latency",
        "overall_throughput",
        "total_latency",
    ),
}


def metric_direction(name: str) -> bool | None:
    """True when higher is better, False when lower is, None when the name does not say.

    Judged on the last dotted component (flattened JSON, one-batch prefixes), lower-cased.
    Higher-is-better words are tried first so "tokens_per_s" is not read as a time in seconds.
    """
    leaf = name.rsplit(".", 1)[-1].lower()
    if leaf in _HIGHER:
        return True
    if leaf in _LOWER:
        return False
    tokens = set(re.split(r"[^a-z0-9]+", leaf))
    if any(word in leaf for word in _HIGHER_SUBSTRINGS) or tokens & _HIGHER_TOKENS or leaf.endswith(_HIGHER_SUFFIXES):
        return True
    if leaf.endswith(_LOWER_SUFFIXES) or any(word in leaf for word in _LOWER_SUBSTRINGS) or tokens & _LOWER_TOKENS:
        return False
    return None


def parse_metric_specs(metrics: Sequence[str]) -> list[tuple[str, bool]]:
    """`["tok_s", "mem:lower"]` -> [(name, higher_is_better)]; unknown directions are refused."""
    if len(metrics) > MAX_METRICS:
        raise LoomError(ErrorCode.BAD_INPUT, f"at most {MAX_METRICS} metrics, got {len(metrics)}")
    specs: list[tuple[str, bool]] = []
    seen: set[str] = set()
    for raw in metrics:
        name, _, suffix = raw.rpartition(":")
        if suffix in ("higher", "lower") and name:
            higher: bool | None = suffix == "higher"
        else:
            name, higher = raw, metric_direction(raw)
        name = name.strip()
        if not name:
            raise LoomError(ErrorCode.BAD_INPUT, f"empty metric name in {raw!r}")
        if name in seen:
            raise LoomError(ErrorCode.BAD_INPUT, f"metric {name!r} is named twice")
        if higher is None:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"cannot tell whether higher or lower is better for metric {name!r}: "
                f"write '{name}:higher' or '{name}:lower'",
            )
        seen.add(name)
        specs.append((name, higher))
    return specs


# ---------------------------------------------------------------- output parsing


class OutputError(ValueError):
    """The output of a run cannot be read as metrics (deterministic: never retried)."""


def _numeric(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects become dotted keys; leaves (lists included) are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last JSON object in `text` that starts at the beginning of a line.

    Scanning from the end, each line starting with '{' is decoded from there on (trailing text
    after the object is ignored), so a one-line object, a pretty-printed one, or a JSONL file's
    last record all work, and log lines around them do not matter.
    """
    decoder = json.JSONDecoder()
    lines = text.splitlines(keepends=True)
    offsets: list[int] = []
    pos = 0
    for line in lines:
        offsets.append(pos)
        pos += len(line)
    tried = 0
    for line, start in zip(reversed(lines), reversed(offsets)):
        if not line.startswith("{"):
            continue
        tried += 1
        if tried > _MAX_JSON_STARTS:
            break
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    # A whole document that is a list of records (a results array): its last object.
    try:
        whole = json.loads(text)
    except ValueError:
        return None
    if isinstance(whole, list):
        records = [item for item in whole if isinstance(item, dict)]
        return records[-1] if records else None
    return whole if isinstance(whole, dict) else None


def _jsonl_objects(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                out.append(value)
    return out


def _is_one_batch(obj: dict[str, Any]) -> bool:
    return "prefill_latency" in obj and "overall_throughput" in obj


def detect_kind(obj: dict[str, Any]) -> Kind:
    """vLLM or SGLang by the keys only they write; anything else is plain json.

    SGLang's markers are checked first: its bench_serving started as a copy of vLLM's and
    shares most names, while input_throughput, *_e2e_latency_ms and the retokenized counts are
    its own. vLLM's own: total_token_throughput, endpoint_type, tokenizer_id.
    """
    if _is_one_batch(obj):
        return "sglang"
    if "request_throughput" in obj:
        if any(
            k in obj
            for k in (
                "input_throughput",
                "median_e2e_latency_ms",
                "total_output_tokens_retokenized",
            )
        ):
            return "sglang"
        if any(k in obj for k in ("total_token_throughput", "endpoint_type", "tokenizer_id")):
            return "vllm"
    return "json"


def _one_batch_values(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of bench_one_batch records; several configurations get a prefix each."""
    fields = (("batch_size", "bs"), ("input_len", "in"), ("output_len", "out"))
    # A configuration written twice keeps its latest record (the file is appended to).
    latest: dict[tuple[str, ...], dict[str, Any]] = {}
    for record in records:
        if _is_one_batch(record):
            key = tuple(repr(record.get(k)) for k, _ in fields)
            latest.pop(key, None)
            latest[key] = record
    configs = list(latest.values())
    if len(configs) <= 1:
        return flatten(configs[-1]) if configs else {}
    varying = [(k, tag) for k, tag in fields if len({repr(r.get(k)) for r in configs}) > 1]
    out: dict[str, Any] = {}
    for record in configs:
        prefix = "_".join(f"{tag}{record.get(k)}" for k, tag in varying)
        out.update(flatten(record, prefix + "."))
    return out


@dataclass
class ParsedOutput:
    kind: Kind
    values: dict[str, Any]
    problem: str | None = None  # set when the tool itself reports failed work


def parse_output(text: str, parser: ParserName) -> ParsedOutput:
    """Metrics of one run's output (stdout or metrics_file). Raises OutputError."""
    obj = last_json_object(text)
    if obj is None:
        raise OutputError("has no JSON object (a line starting with '{')")
    detected = detect_kind(obj)
    kind: Kind = detected if parser == "auto" else parser
    if parser in ("vllm", "sglang") and detected != parser:
        expected = "request_throughput and vLLM's total_token_throughput"
        if parser == "sglang":
            expected = "bench_serving's request_throughput/input_throughput or bench_one_batch's prefill_latency/overall_throughput"
        raise OutputError(f"does not look like {parser} output (no {expected})")
    if kind == "sglang" and _is_one_batch(obj):
        values = _one_batch_values(_jsonl_objects(text) or [obj])
    else:
        values = flatten(obj)
    return ParsedOutput(kind, values, _tool_problem(kind, values))


def _tool_problem(kind: Kind, values: dict[str, Any]) -> str | None:
    if kind not in ("vllm", "sglang") or "completed" not in values:
        return None
    completed, failed = values.get("completed"), values.get("failed")
    if _numeric(failed) and failed > 0:
        total = completed + failed if _numeric(completed) else "?"
        return f"{kind} reports {failed} of {total} requests failed"
    if _numeric(completed) and completed <= 0:
        return f"{kind} reports no request completed"
    return None


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__


def available_metrics(values: dict[str, Any], limit: int = 25) -> str:
    names = [k for k, v in values.items() if _numeric(v)]
    shown = ", ".join(names[:limit])
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return (shown + more) if names else "no numeric values"


def metric_value(values: dict[str, Any], name: str) -> float:
    """A metric as a positive finite float, or OutputError saying what is wrong with it."""
    if name not in values:
        raise OutputError(f"has no metric {name!r}; numeric metrics there: {available_metrics(values)}")
    value = values[name]
    if not _numeric(value):
        raise OutputError(f"metric {name!r} is {_describe(value)}, not a number")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise OutputError(f"metric {name!r} is {value}; a ratio needs a positive finite value")
    return number


def default_metrics(kind: Kind, first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Headline metrics present, positive and of known direction in both arms' first runs."""

    def usable(name: str) -> bool:
        return all(_numeric(v.get(name)) and math.isfinite(v[name]) and v[name] > 0 for v in (first, second))

    names = [k for k in first if usable(k)]
    headline = _DEFAULTS.get(kind)
    if headline:
        rank = {leaf: i for i, leaf in enumerate(headline)}
        names = [k for k in names if k.rsplit(".", 1)[-1] in rank]
        names.sort(key=lambda k: rank[k.rsplit(".", 1)[-1]])  # stable: prefixes keep order
    else:
        names = [k for k in names if metric_direction(k) is not None]
    return names[:MAX_DEFAULT_METRICS]
