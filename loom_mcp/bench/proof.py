"""Proof of execution: the candidate's own kernels, by name, seen in a profiler trace taken in
a third, untimed process of the candidate's."""

from __future__ import annotations

import logging
import re
import time

from loom_mcp.bench.arms import ArmConnection, ArmError

log = logging.getLogger("loom_mcp.bench")


def declared_kernels(source: str) -> set[str]:
    """Kernel names a candidate defines itself: @triton.jit functions and __global__ functions."""
    names = set(re.findall(r"@triton\.(?:jit|autotune|heuristics)[\s\S]*?def\s+(\w+)", source))
    names |= set(re.findall(r"__global__\s+void\s+(\w+)", source))
    return names


async def prove_execution(
    arms: dict[str, ArmConnection], declared: set[str], last_shape: int, timeout_s: float
) -> tuple[bool | None, str, bool]:
    """(proof, note, applicable): whether the profiler saw a kernel the candidate declares, why
    not where it could not tell, and whether there was anything to prove."""
    proof, note = None, "proof of execution needs a GPU profiler (CPU run)"
    if not declared:
        # A candidate with no kernels of its own has nothing to prove (and no profiler starts).
        return None, "the candidate defines no kernels of its own; nothing to prove", False
    listing: dict = {"kernels": None}
    if "proof" in arms:  # on a GPU (see benchmark_candidate)
        proof_started = time.monotonic()
        try:
            started = await arms["proof"].receive(timeout_s)  # trace_start, sent before the load
            await arms["proof"].receive(timeout_s)  # load
            listing = await arms["proof"].ask({"op": "trace", "shape": last_shape}, timeout_s)
        except ArmError as exc:  # no profiler here (permissions, no CUPTI), or the process died
            note = f"no proof of execution: the proof process failed ({exc})"
        else:
            log.info(
                "benchmark: proof-of-execution trace %.2f s after the timing (profiler start %s, trace %s)",
                time.monotonic() - proof_started,
                started.get("seconds"),
                listing.get("seconds"),
            )
    if isinstance(listing.get("kernels"), list):
        seen = [str(k) for k in listing["kernels"]]
        hit = sorted(d for d in declared if any(d in k for k in seen))
        proof = bool(hit)
        note = (
            f"seen in the profiler trace: {', '.join(hit)}"
            if hit
            else f"none of {sorted(declared)} appeared among {len(seen)} kernels launched"
        )
    return proof, note, True
