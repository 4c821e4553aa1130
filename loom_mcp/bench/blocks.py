"""The wall-clock mode's blocks (a fresh timer and pair of arms each): their samples pooled per
shape, labelled by block, and what every block's arms report said once."""

from __future__ import annotations

import math
import statistics
from typing import Any

from loom_mcp.judge_models import Finding, ShapeSamples


def merge_block(samples: dict[str, dict[str, Any]], timed: dict[str, dict[str, Any]], block: int) -> None:
    """Adds one block's samples to the benchmark's, pooled per shape with every pair labelled
    by its block, so the statistics can take one ratio per block.

    Each block's samples keep the bracket cost its own empty calls measured subtracted: one
    cost for all blocks (their median) floored a forged-clock candidate's few-microsecond calls
    to nothing in the blocks whose round trip was quicker (26x). The median of the blocks' costs
    is what the evidence reports."""
    for name, record in timed.items():
        into = samples.setdefault(
            name, {"a": [], "b": [], "throttled": [], "blocks": [], "overheads": [], "stops": [], "seconds": 0.0}
        )
        into["a"].extend(record["a"])
        into["b"].extend(record["b"])
        deviation = into.setdefault("deviation", [0.0, 0.0, 0])
        for i, part in enumerate(record.get("deviation") or (0.0, 0.0, 0)):
            deviation[i] += part
        into["throttled"].extend(record["throttled"])
        into["fresh_inputs"] = into.get("fresh_inputs", True) and bool(record.get("fresh_inputs"))
        into["blocks"].extend([block] * len(record["a"]))
        into["overheads"].append(record.get("overhead", 0.0))
        into["overhead"] = statistics.median(into["overheads"])
        into["stops"].append(record.get("stop"))
        into["stop"] = "time_cap" if "time_cap" in into["stops"] else record.get("stop")
        into["seconds"] += record.get("seconds") or 0.0


def output_deviation(record: dict[str, Any]) -> tuple[float | None, int]:
    """(||candidate - baseline|| / ||baseline|| over every sampled output of a shape, how many
    samples); None without samples or with an all-zero baseline."""
    dev, ref, n = record.get("deviation") or (0.0, 0.0, 0)
    return (math.sqrt(dev / ref) if n and ref > 0 else None), int(n)


def block_shapes(shape_meta: list[dict], samples: dict[str, dict[str, Any]]) -> list[ShapeSamples]:
    """The samples as the statistics take them; with block labels where blocks were merged (CPU
    wall clock)."""
    shapes = []
    for m in shape_meta:
        if m["name"] not in samples:
            continue
        deviation, deviation_samples = output_deviation(samples[m["name"]])
        shapes.append(
            ShapeSamples(
                name=m["name"],
                baseline_s=samples[m["name"]]["a"],
                candidate_s=samples[m["name"]]["b"],
                throttled=samples[m["name"]]["throttled"],
                blocks=samples[m["name"]].get("blocks"),
                flops=m["flops"],
                bytes_moved=m["bytes_moved"],
                stop_reason=samples[m["name"]].get("stop"),
                sampling_s=samples[m["name"]].get("seconds"),
                output_deviation=deviation,
                output_samples=deviation_samples,
                fresh_inputs=samples[m["name"]].get("fresh_inputs"),
            )
        )
    return shapes


def unique_findings(findings: list[Finding]) -> list[Finding]:
    """Each finding once: every block's arms report what they did again."""
    seen: dict[str, Finding] = {}
    for finding in findings:
        seen.setdefault(finding.model_dump_json(), finding)
    return list(seen.values())
