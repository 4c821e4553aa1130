"""The timing loop of one block: every shape's ABBA pairs through the trusted timer, each pair
checked as it comes (outputs, tampering, the idle arm), until the stopping rule says enough."""

from __future__ import annotations

import logging
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from loom_mcp.bench.arm_procs import IdleWatch, busy_finding
from loom_mcp.bench.arms import ArmConnection
from loom_mcp.bench.output_check import call_agrees, samples_disagreeing, shape_disagrees, squared_deviation
from loom_mcp.bench.proof import prove_execution
from loom_mcp.bench.summary import paired_stop_reason
from loom_mcp.bench.trusted import (
    EMPTY_CALLS,
    candidate_bracket_cost,
    harness_residual,
    subtract_overhead,
    trusted_pairs,
)
from loom_mcp.judge_models import Finding, GateConfig

log = logging.getLogger("loom_mcp.bench")


async def run_pairs(
    arms: dict[str, ArmConnection],
    shape_meta: list[dict],
    samples: dict[str, dict[str, Any]],
    gate: GateConfig,
    timeout_s: float,
    clock_sampler: Callable[[], dict[str, Any]] | None,
    findings: list[Finding],
    say: Callable[[str], Awaitable[None]],
    declared: set[str],
    candidate_pid: int | None,
    first_pair: int = 0,
    idle_totals: dict[str, list[float]] | None = None,
) -> tuple[bool, bool | None, str, bool]:
    """Times every shape; returns whether a graph was replayed, and the proof of execution's
    outcome (see prove_execution)."""
    graph_used = False
    mismatch_reported = False
    tamper_reported: set[str] = set()
    for shape_index, meta in enumerate(shape_meta):
        name = meta["name"]
        setup_started = time.monotonic()
        setup = await arms["timer"].ask({"op": "setup", "shape": shape_index}, timeout_s)
        graph_used = graph_used or bool(setup.get("graph"))
        started = time.monotonic()
        pair = 0
        probes = probes_off = 0  # sampled outputs compared over all of this shape's calls
        record = samples[name]
        record["fresh_inputs"] = bool(setup.get("fresh_inputs"))
        idle = IdleWatch(candidate_pid) if candidate_pid else None
        late = 0  # calls whose work was done before the timer could queue its end event
        raw: dict[str, list[float]] = {"baseline": [], "candidate": []}
        lateness: dict[str, list[bool]] = {"baseline": [], "candidate": []}
        overhead: dict[str, list[float]] = {"baseline": [], "candidate": []}
        while True:
            probe = [secrets.randbelow(1 << 30) for _ in range(32)]
            salt = secrets.randbits(62)  # seeds every draw and noise of the pair: see timer.seed_of
            before = clock_sampler() if clock_sampler else None
            # ABBA, and a block that starts with the other arm: order effects cancel across blocks.
            order = ["baseline", "candidate"] if (pair + first_pair) % 2 == 0 else ["candidate", "baseline"]
            got: dict[str, Any] = {"arms": {}}
            for role in order:
                # One arm's pass at a time, so the server can see what the idle candidate does
                # while the baseline is timed.
                watching = role == "baseline" and idle is not None
                if watching:  # a /proc scan: off the event loop
                    assert idle is not None  # watching implies it
                    cpu_before = await anyio.to_thread.run_sync(idle.cpu_s)
                    wall_before = time.monotonic()
                part = await arms["timer"].ask(
                    {"op": "batch", "order": [role], "salt": salt, "probe": probe, "empties": EMPTY_CALLS}, timeout_s
                )
                if watching:
                    wall = time.monotonic() - wall_before
                    assert idle is not None  # watching implies it
                    idle.add(await anyio.to_thread.run_sync(idle.cpu_s) - cpu_before, wall)
                got["arms"].update(part["arms"])
                overhead["baseline"].extend(part.get("overhead") or [])
                overhead["candidate"].extend(part.get("overhead_candidate") or [])
                late = part.get("late", 0)
            after = clock_sampler() if clock_sampler else None
            throttled = bool((before or {}).get("throttled") or (after or {}).get("throttled"))
            base, cand = got["arms"]["baseline"], got["arms"]["candidate"]
            # Element i of both arms timed the same input set with the same content: a pair.
            raw["baseline"].extend(base["times"])
            raw["candidate"].extend(cand["times"])
            for role, arm_part in (("baseline", base), ("candidate", cand)):
                lateness[role].extend(arm_part.get("late") or [False] * len(arm_part["times"]))
            record["throttled"].extend([throttled] * len(base["times"]))
            # The timer's brackets hold its own cost (a context switch each way on a GPU, a
            # socket round trip on a CPU); each arm's empty calls measure it for that arm.
            record["overhead"] = statistics.median(overhead["baseline"]) if overhead["baseline"] else 0.0
            # Strict: the candidate's switch never dearer than the baseline's. That reading is
            # the CPU's samples and what clears an own clock; the lenient one only sends to review.
            candidate_overhead = candidate_bracket_cost(record["overhead"], overhead["candidate"], spread=0.0)
            lenient_overhead = candidate_bracket_cost(record["overhead"], overhead["candidate"])
            kept = trusted_pairs(raw["baseline"], raw["candidate"], lateness["baseline"], lateness["candidate"])
            trusted_a = subtract_overhead([a for a, _ in kept], record["overhead"])
            trusted_b = subtract_overhead([b for _, b in kept], candidate_overhead)
            if base.get("own_times") is not None and cand.get("own_times") is not None:
                # GPU: the arms' own events are the precise samples; the timer's brackets of the
                # same calls are what they are checked against (see trusted.flag_disagreement).
                record["a"].extend(base["own_times"])
                record["b"].extend(cand["own_times"])
                residual = harness_residual(trusted_a, record["a"])
                record["harness_residual_s"] = residual
                record["trusted_a"] = subtract_overhead(trusted_a, residual)
                record["trusted_b"] = subtract_overhead(trusted_b, residual)
                lenient_b = subtract_overhead([b for _, b in kept], lenient_overhead)
                record["trusted_b_lenient"] = subtract_overhead(lenient_b, residual)
            else:
                record["a"], record["b"] = trusted_a, trusted_b
            for role in ("baseline", "candidate"):
                if got["arms"][role].get("tampered") and role not in tamper_reported:
                    tamper_reported.add(role)
                    findings.append(
                        Finding(
                            check="benchmark.timer_tampering",
                            severity="warning",
                            message=f"the {role} replaced harness functions while timed "
                            f"({', '.join(got['arms'][role]['tampered'])}); the timing is "
                            "taken in another process, so it changed no number",
                        )
                    )
            agree = cand["samples"] is not None and base["samples"] is not None
            if agree:
                for c_call, b_call in zip(cand["samples"], base["samples"], strict=True):
                    if len(c_call) != len(b_call):
                        agree = False
                        continue
                    for c, b in zip(c_call, b_call, strict=True):
                        off = samples_disagreeing(c, b)
                        agree = agree and call_agrees(off, len(b))
                        probes_off += len(b) if off is None else off
                        probes += len(b)
                        sums: list[float] = record.setdefault("deviation", [0.0, 0.0, 0])
                        for i, value in enumerate(squared_deviation(c, b)):
                            sums[i] += value
            if not agree and not mismatch_reported:
                mismatch_reported = True
                why = cand.get("error") or base.get("error") or "values differ at sampled positions"
                findings.append(
                    Finding(
                        check="benchmark.output_mismatch",
                        severity="error",
                        message=f"{name}: while being timed the candidate's output differs from the "
                        f"baseline's ({why}; honest only when validated?)",
                    )
                )
            pair += 1
            elapsed = time.monotonic() - started
            stop = paired_stop_reason(record["a"], record["b"], gate, elapsed)
            if stop:
                record["stop"], record["seconds"] = stop, elapsed
                break
            if pair % 20 == 0:
                await say(f"{name}: {pair} pairs, {elapsed:.1f} s")
        if idle is not None and idle_totals is not None:
            # Blocks: judged over all of them, as one block's passes hold a few clock ticks only.
            total = idle_totals.setdefault(name, [0.0, 0.0])
            total[0] += idle.cpu
            total[1] += idle.wall
        elif idle is not None and idle.busy():
            findings.append(busy_finding(name, idle.cpu, idle.wall))
        if shape_disagrees(probes_off, probes) and not mismatch_reported:
            mismatch_reported = True
            findings.append(
                Finding(
                    check="benchmark.output_mismatch",
                    severity="error",
                    message=f"{name}: while being timed {probes_off} of {probes} sampled outputs "
                    "differed from the baseline's (more than a tenth; honest only when "
                    "validated?)",
                )
            )
        log.info(
            "benchmark %s: setup %.2f s, %d pairs (%d samples per arm) in %.2f s, stopped: %s, %d late calls",
            name,
            started - setup_started,
            pair,
            len(record["a"]),
            elapsed,
            stop,
            late,
        )
        if record.get("trusted_a") and record.get("trusted_b"):
            log.info(
                "benchmark %s: %d of %d pairs late; medians, own events %.2f / %.2f us, brackets %.2f / %.2f us "
                "(context switch %.2f / %.2f us, harness %.2f us and hand-over %s subtracted)",
                name,
                sum(a or b for a, b in zip(lateness["baseline"], lateness["candidate"])),
                len(lateness["baseline"]),
                *(1e6 * statistics.median(record[k]) for k in ("a", "b", "trusted_a", "trusted_b")),
                1e6 * record["overhead"],
                1e6 * candidate_overhead,
                1e6 * record.get("harness_residual_s", 0.0),
                {role: f"{1e6 * v:.2f} us" for role, v in (setup.get("copy_s") or {}).items()},
            )
        await say(f"{name}: {pair} pairs done")
    return (graph_used, *await prove_execution(arms, declared, len(shape_meta) - 1, timeout_s))
