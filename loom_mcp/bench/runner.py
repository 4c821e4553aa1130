"""benchmark: interleaved A/B timing of a candidate against a baseline, judged in the server.

The task's inputs are prepared by the trusted reference worker; two warm sandboxed arms
(baseline, candidate) connect back over a Unix socket and time one sample per request, in
ABBA order. The server keeps every sample, samples clocks between pairs, compares
output samples taken at secret positions, applies the stopping rule, and computes the statistics.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from loom_mcp.bench.stats import analyze_shapes, more_blocks_needed
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import (
    BenchmarkEvidence,
    Finding,
    GateConfig,
    RatioCI,
    ShapeSamples,
    TimerKind,
)
from loom_mcp.models import DevicePeak
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobSpec, code_cache, code_cache_env, procs, safefs, warm
from loom_mcp.sandbox.job import MODEL_JOB_ENV
from loom_mcp.sandbox.runner import Progress, supervise
from loom_mcp.worker.guard import findings as guard_findings

log = logging.getLogger("loom_mcp.bench")
GRAPH_BELOW_S = 50e-6  # eager launch gaps distort kernels shorter than this: replay a graph
SAMPLE_RTOL = 2e-2  # see samples_disagreeing
SAMPLE_SCALE_TOL = 1e-2


class ArmConnection:
    def __init__(self, stream: SocketStream, role: str) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.role = role

    async def ask(self, command: dict, timeout_s: float) -> dict:
        await self.send(command)
        return await self.receive(timeout_s)

    async def send(self, command: dict) -> None:
        try:
            await self.stream.send((json.dumps(command) + "\n").encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ArmError(self.role, f"its connection is gone ({type(exc).__name__})") from exc

    async def receive(self, timeout_s: float) -> dict:
        """The next reply. What the other end sends is not trusted (the arms and the proof process
        run candidate code): a connection that ends, or a reply that is not a JSON object, is
        that process's failure (ArmError), never the server's."""
        with anyio.fail_after(timeout_s):
            try:
                line = await self.reader.receive_until(b"\n", max_bytes=1 << 20)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                    anyio.ClosedResourceError, anyio.DelimiterNotFound) as exc:
                raise ArmError(self.role, f"its connection ended ({type(exc).__name__})") from exc
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise ArmError(self.role, "it sent a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise ArmError(self.role, "it sent a reply that is not an object")
        if reply.get("error"):
            # The timer relays its arms' failures with the arm's role.
            raise ArmError(str(reply.get("arm") or self.role), reply["error"])
        return reply


async def farewell(conn: ArmConnection) -> dict:
    """Send quit and read its reply, past any reply a failed timing left unread (the proof
    process answers trace_start and load only when asked for them after the timing)."""
    try:
        await conn.send({"op": "quit"})
    except Exception:
        return {}
    for _ in range(4):
        try:
            reply = await conn.receive(5)
        except ArmError:
            continue
        except Exception:
            return {}
        if reply.get("bye"):
            return reply
    return {}


class ArmError(Exception):
    def __init__(self, role: str, message: str) -> None:
        super().__init__(f"{role}: {message}")
        self.role = role


def declared_kernels(source: str) -> set[str]:
    """Kernel names a candidate defines itself: @triton.jit functions and __global__ functions."""
    import re

    names = set(re.findall(r"@triton\.(?:jit|autotune|heuristics)[\s\S]*?def\s+(\w+)", source))
    names |= set(re.findall(r"__global__\s+void\s+(\w+)", source))
    return names


EMPTY_CALLS = 2  # empty brackets per batch, run by the baseline arm: the timer's own cost
MIN_CORRECTED_S = 1e-8


def subtract_overhead(times: list[float], overhead: float) -> list[float]:
    """Call times less the bracket's own cost, floored so a noisy short call stays positive."""
    return [max(t - overhead, MIN_CORRECTED_S) for t in times]


class IdleWatch:
    """CPU time the candidate's processes burn while the baseline is being timed.

    An idle arm blocks on its socket. One that keeps processes busy meanwhile (a red-team
    candidate's DataLoader workers, forked by torch so the audit hook let them be) slows the
    baseline down and reached a CI low above 1.05 with no faster code. Read from /proc, outside
    the arm: user + system time of its launcher's tree, reaped children included."""

    BUSY_FRACTION = 0.25  # of the baseline's pass time
    BUSY_MIN_S = 0.05  # a few clock ticks: /proc counts in 10 ms steps
    RESCAN_EVERY = 10  # passes between scans for new processes

    def __init__(self, root: int) -> None:
        self.root = root
        self.pids: list[int] = []
        self.passes = 0
        self.cpu = 0.0
        self.wall = 0.0

    def cpu_s(self) -> float:
        if self.passes % self.RESCAN_EVERY == 0:
            self.pids = [self.root, *procs.descendants(self.root)]
        return sum(procs.cpu_seconds(pid) for pid in self.pids)

    def add(self, cpu: float, wall: float) -> None:
        self.passes += 1
        self.cpu += max(cpu, 0.0)
        self.wall += wall

    def busy(self) -> bool:
        return self.exceeds(self.cpu, self.wall)

    @classmethod
    def exceeds(cls, cpu: float, wall: float) -> bool:
        return cpu > max(cls.BUSY_MIN_S, cls.BUSY_FRACTION * wall)


def busy_finding(shape: str, cpu: float, wall: float) -> Finding:
    return Finding(
        check="benchmark.busy_while_idle", severity="error",
        message=f"{shape}: the candidate's processes used {cpu:.2f} s of CPU while "
                f"the baseline was timed ({wall:.2f} s of its passes): work aimed "
                "at the other arm")


# How far the arms' own timings may claim more speed than the trusted timer's brackets of the
# same calls allow (beyond the brackets' CI). The brackets carry a context switch each way; on
# the H200 they read identical arms up to 7 % apart in one benchmark, so less would reject
# honest work. A forged clock gains at most this much.
OWN_TIMING_ALLOWANCE = 0.10


def trusted_geomean_of(shape_meta, samples, gate: GateConfig) -> RatioCI | None:
    """The geomean speedup by the trusted timer's brackets alone, where the arms timed
    themselves as well (GPU); None where the brackets are the samples already (CPU)."""
    trusted = [ShapeSamples(name=m["name"], baseline_s=samples[m["name"]]["trusted_a"],
                            candidate_s=samples[m["name"]]["trusted_b"])
               for m in shape_meta if samples[m["name"]].get("trusted_a")]
    if not trusted:
        return None
    return analyze_shapes(trusted, gate).geomean


def trusted_pairs(baseline: list[float], candidate: list[float], baseline_late: list[bool],
                  candidate_late: list[bool]) -> list[tuple[float, float]]:
    """The bracket pairs the trusted side is computed from. A late bracket (the arm's work was
    done before the timer queued its end event, so it also timed launch latency) drops its
    pair. An arm late on purpose (replying only once its work is done) must not empty the
    trusted side: when fewer than half the pairs are on time, every pair counts, and a late
    bracket only makes its own arm look slower."""
    both = list(zip(baseline, candidate, strict=True))
    late = [a or b for a, b in zip(baseline_late, candidate_late, strict=True)]
    kept = [pair for pair, was_late in zip(both, late, strict=True) if not was_late]
    return kept if len(kept) * 2 >= len(both) else both


def flag_disagreement(trusted: RatioCI, own: RatioCI, findings: list[Finding]) -> None:
    """An error finding (the gate rejects) when the arms' own clocks claim a speedup the trusted
    timer's brackets cannot support: a clock rewritten inside the candidate's process."""
    if own.estimate > trusted.ci_high * (1 + OWN_TIMING_ALLOWANCE):
        findings.append(Finding(
            check="benchmark.timing_disagreement", severity="error",
            message=f"the arms' own clocks give {own.estimate:.3f}x but the trusted timer's "
                    f"brackets of the same calls give {trusted.estimate:.3f}x "
                    f"[{trusted.ci_low:.3f}, {trusted.ci_high:.3f}]: more than "
                    f"{OWN_TIMING_ALLOWANCE:.0%} apart (a clock changed inside the candidate's "
                    "process?)"))


def samples_disagreeing(candidate: list[float] | None, baseline: list[float] | None) -> int | None:
    """How many of the candidate's sampled outputs differ from the baseline's; None when the two
    cannot be compared at all (missing, or not the same positions).

    Both arms timed the same freshly perturbed inputs (every element scaled by U(0.9, 1.1)),
    so an output computed from stale inputs or taken from a cache is off by a few percent at
    most positions. An honest kernel differs by rounding only: one bf16 step is 0.4-0.8 %, and
    validation has already held it to the task's tolerance. The bound here is loose for
    rounding and tight for stale data: 2 % of the value plus 1 % of the samples' median size
    (so near-zero outputs compare on the output's scale, not their own).
    """
    if candidate is None or baseline is None or len(candidate) != len(baseline):
        return None
    finite = [abs(y) for y in baseline if math.isfinite(y)]
    scale = statistics.median(finite) if finite else 0.0
    off = 0
    for x, y in zip(candidate, baseline, strict=True):
        if math.isnan(x) and math.isnan(y):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            off += x != y
        elif abs(x - y) > SAMPLE_RTOL * abs(y) + SAMPLE_SCALE_TOL * scale + 1e-12:
            off += 1
    return off


def call_agrees(off: int | None, probes: int) -> bool:
    """One call's samples agree unless more than a quarter of them differ, so one unlucky
    element cannot reject a kernel; `shape_disagrees` looks at all of a shape's calls."""
    return off is not None and off * 4 <= probes


def samples_agree(candidate: list[float] | None, baseline: list[float] | None) -> bool:
    return call_agrees(samples_disagreeing(candidate, baseline), len(baseline or []))


def shape_disagrees(off: int, total: int) -> bool:
    """Over every timed call of a shape: more than a tenth of the sampled outputs differ.

    A candidate that skips a tenth of its work only while timed stays under a quarter in most
    single calls, but not in the sum of hundreds. An honest kernel differing at a tenth of the
    positions would already fail some single calls over that many (the chance that 32 probes
    at 10 % show more than 8 is 0.4 % per call), so this flags nothing the per-call rule spares.
    """
    return total > 0 and off * 10 > total


def merge_block(samples: dict[str, dict[str, Any]], timed: dict[str, dict[str, Any]],
                block: int) -> None:
    """Adds one block's samples to the benchmark's, pooled per shape with every pair labelled
    by its block, so the statistics can take one ratio per block.

    Each block's samples keep the bracket cost its own empty calls measured subtracted: one
    cost for all blocks (their median) floored a forged-clock candidate's few-microsecond calls
    to nothing in the blocks whose round trip was quicker (26x). The median of the blocks' costs
    is what the evidence reports."""
    for name, record in timed.items():
        into = samples.setdefault(name, {"a": [], "b": [], "throttled": [], "blocks": [],
                                         "overheads": [], "stops": [], "seconds": 0.0})
        into["a"].extend(record["a"])
        into["b"].extend(record["b"])
        into["throttled"].extend(record["throttled"])
        into["blocks"].extend([block] * len(record["a"]))
        into["overheads"].append(record.get("overhead", 0.0))
        into["overhead"] = statistics.median(into["overheads"])
        into["stops"].append(record.get("stop"))
        into["stop"] = "time_cap" if "time_cap" in into["stops"] else record.get("stop")
        into["seconds"] += record.get("seconds") or 0.0


def block_shapes(shape_meta: list[dict], samples: dict[str, dict[str, Any]]) -> list[ShapeSamples]:
    """The merged blocks' samples as the statistics take them (CPU wall clock)."""
    return [ShapeSamples(name=m["name"], baseline_s=samples[m["name"]]["a"],
                         candidate_s=samples[m["name"]]["b"],
                         throttled=samples[m["name"]]["throttled"], blocks=samples[m["name"]]["blocks"],
                         flops=m["flops"], bytes_moved=m["bytes_moved"],
                         stop_reason=samples[m["name"]].get("stop"),
                         sampling_s=samples[m["name"]].get("seconds"))
            for m in shape_meta if m["name"] in samples]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def arm_interpreter(root: int) -> int | None:
    """The arm's own interpreter under its sandbox launcher: the topmost process running the
    bench worker. What it forks shares its command line, and what it spawns has another: both
    are left out."""
    worker = b"loom_mcp.worker.bench"
    for pid in [root, *procs.descendants(root)]:
        if worker in _cmdline(pid):
            parent = procs.parent_pid(pid)
            if parent is None or worker not in _cmdline(parent):
                return pid
    return None


def pin_to_cpu(roots: list[int], cpu: int) -> int:
    """Pins every thread of the arms' interpreters to one CPU; returns how many were pinned.
    The arms never run at once, so sharing a core costs no time, and they meet the same
    neighbours: on a busy machine an arm placed beside another job's process read 2-4x slower
    for its whole life. The candidate's other processes stay unpinned, so a helper busy while
    the baseline runs does not get the baseline's core as well. Best effort: a thread that
    ended or refuses is left as it is."""
    pinned = 0
    for root in roots:
        pid = arm_interpreter(root)
        try:
            threads = os.listdir(f"/proc/{pid}/task") if pid else []
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(int(tid), {cpu})
                pinned += 1
            except (OSError, ValueError):
                pass
    return pinned


def unique_findings(findings: list[Finding]) -> list[Finding]:
    """Each finding once: every block's arms report what they did again."""
    seen: dict[str, Finding] = {}
    for finding in findings:
        seen.setdefault(finding.model_dump_json(), finding)
    return list(seen.values())


async def benchmark_candidate(
    *,
    task: Path,
    candidate: Path,
    baseline: Path | None,
    job_dir: Path,
    shapes: list[str] | None,
    device: str,
    gate: GateConfig,
    peak: DevicePeak | None,
    flush_bytes: int,
    timeout_s: float,
    benchmark_id: str,
    clock_sampler: Callable[[], dict[str, Any]] | None = None,
    keep_warm: bool = True,
    progress: Progress | None = None,
    task_globals: dict[str, Any] | None = None,
) -> tuple[BenchmarkEvidence, list[Finding]]:
    async def say(message: str) -> None:
        if progress:
            await progress(message)

    job_dir.mkdir(parents=True, exist_ok=True)
    timer_device = device
    device, env, visible = job_placement(device)
    # Trusted input preparation in a warm worker when one is idle: its start-up was seconds on the
    # critical path. No new one is started until the timing is over (it would compete for cores).
    prep_template = JobSpec(argv=warm.warm_argv(sys.executable, "loom_mcp.worker.reference"),
                            job_dir=job_dir / "prep", env=env, visible_devices=visible, timeout_s=timeout_s)
    pool_dir = job_dir.parent / "warm"
    prep_worker = await warm.take(prep_template, pool_dir, refill=False)
    # Blank workers for the arms and the timer (see sandbox/warm.py), not on a CPU by default:
    # there every block is fresh processes on purpose, and their start-up would take the cores.
    use_blanks = keep_warm and warm.blanks_for(device)
    arm_base_env = {**env, **MODEL_JOB_ENV}
    timer_role = {"LOOM_BENCH_ROLE": "timer"}
    blanks: dict[str, tuple[JobSpec, dict[str, str], int]] = {}  # kind -> a spec, base env, depth
    cases_file = prep_worker.job_dir / "bench_cases"  # a tensor bundle (worker/handoff.py)
    # AF_UNIX paths are limited to ~107 bytes; a deep LOOM_HOME would overflow it, so the sockets
    # live in a short private directory of their own.
    sock_dir = Path(tempfile.mkdtemp(prefix="loom-", dir="/tmp" if Path("/tmp").is_dir() else None))
    # CUDA IPC names its state after the exporter's pid in /dev/shm: on a GPU the benchmark's
    # processes share one /dev/shm of their own (each job's is private otherwise).
    shm_dir = (Path(tempfile.mkdtemp(prefix="loom-shm-", dir="/dev/shm" if Path("/dev/shm").is_dir()
                                     else None)) if device != "cpu" else None)
    arms_spec = {
        "baseline": (baseline or task, "ModelNew" if baseline else "Model"),
        "candidate": (candidate, "ModelNew"),
    }
    declared = declared_kernels(safefs.read_resolved_text(candidate))
    if device != "cpu" and declared:
        # The proof of execution runs in a third process of the candidate's: its profiler's
        # start-up (4-5 s on the H200 host) overlaps the timing instead of following it, and the
        # timed arms never have a profiler attached.
        arms_spec["proof"] = (candidate, "ModelNew")
    findings: list[Finding] = []
    shape_meta: list[dict] = []
    prepared = anyio.Event()
    prep_box: dict[str, Any] = {}
    # On a CPU one process keeps a few percent of speed or slowness for its whole life
    # (placement, layout, allocator state), so one pair of arms cannot show the run-to-run
    # spread: there each block is a fresh timer and pair of arms, and the CI is across blocks.
    wall_clock = device == "cpu"
    block_gate = gate.model_copy(update={
        "min_time_s": min(gate.min_time_s, gate.wall_clock_block_time_s),
        "max_time_s": gate.wall_clock_block_time_s}) if wall_clock else gate
    outcome: dict[str, Any] = {"proof": (False, None, None, True)}
    idle_totals: dict[str, list[float]] = {}  # wall clock: per shape, over all blocks

    async def prepare() -> None:
        # Runs while the arms start: their imports and device setup overlap it.
        prep_box["job"] = await warm.run_warm(
            prep_worker, {"mode": "prepare_bench", "task": str(task), "shapes": shapes,
                          "cases_file": str(cases_file), "max_sets": 2, "device": device,
                          "task_globals": task_globals or {}},
            secret_env={"LOOM_NONCE": str(secrets.randbits(62))}, timeout_s=timeout_s,
            on_progress=progress)
        prepared.set()

    async def run_block(block: int) -> dict[str, dict[str, Any]]:
        """One timer and one pair of arms, fresh processes, timing every shape in ABBA pairs."""
        where = job_dir if block == 0 else job_dir / f"block{block}"
        suffix = "" if block == 0 else f"-{block}"
        # One secret per process: an arm reads its own request, so with one shared token the
        # candidate could connect a second time as the baseline (or as the timer) and answer for it.
        tokens = {role: secrets.token_hex(16) for role in ("timer", "baseline", "candidate", "proof")}
        sock_path = sock_dir / f"server{suffix}.sock"
        timer_sock = sock_dir / f"timer{suffix}.sock"  # the timed arms talk to the trusted timer only
        # What the timer shares with the arms: input files every arm reads, and per arm a
        # directory of output slots only that arm may write (so neither sees the other's outputs).
        exchange = where / "exchange"
        for sub in ("in", "out-baseline", "out-candidate"):
            (exchange / sub).mkdir(parents=True, exist_ok=True)
        samples: dict[str, dict[str, Any]] = {}
        arm_results: dict[str, Any] = {}
        launchers: dict[str, int] = {}  # role -> pid of its sandbox launcher (host pid namespace)
        startup: dict[str, Any] = {"done": False, "scope": anyio.CancelScope()}
        failure: Exception | None = None
        try:
            async with await anyio.create_unix_listener(sock_path) as listener:
                async def launch(role: str) -> None:
                    if role == "timer":  # trusted: never imports the code under test
                        timer_spec = JobSpec(
                            argv=[sys.executable, "-m", "loom_mcp.worker.timer"], job_dir=where / role,
                            # TMPDIR: torch's shared-memory manager socket, which the arms connect to
                            env={**env, "TMPDIR": str(sock_dir), **timer_role}, visible_devices=visible,
                            timeout_s=timeout_s, writable=[sock_dir, exchange],
                            readable=[prep_worker.job_dir], shm_dir=shm_dir,
                            request={"socket": str(sock_path), "arms_socket": str(timer_sock),
                                     "token": tokens["timer"],
                                     "arm_tokens": {r: tokens[r] for r in ("baseline", "candidate")},
                                     "cases_file": str(cases_file), "device": device,
                                     "flush_bytes": flush_bytes, "rotate_bytes": flush_bytes,
                                     "max_sets": 8, "exchange": str(exchange)})
                        blanks["timer"] = (timer_spec, {**env, **timer_role}, 1)
                        launched = await warm.start(timer_spec, pool_dir, base_env={**env, **timer_role},
                                                    blank=use_blanks, refill=False)
                        arm_results[role] = await supervise(launched)
                        if not startup["done"]:
                            startup["scope"].cancel()
                        return
                    module, class_name = arms_spec[role]
                    cache = code_cache(job_dir, Path(module))
                    slots = [exchange / f"out-{role}"] if role != "proof" else []
                    arm_spec = JobSpec(
                        argv=[sys.executable, "-m", "loom_mcp.worker.bench"], job_dir=where / role,
                        env={**arm_base_env, "LOOM_BENCH_ROLE": role, **code_cache_env(cache)},
                        writable=[cache, *slots],
                        visible_devices=visible,
                        # read-only: an arm may connect to the sockets there, never replace one
                        readable=[Path(module).parent, prep_worker.job_dir, sock_dir, exchange / "in"],
                        shm_dir=shm_dir,
                        timeout_s=timeout_s,
                        request={"role": role, "module": str(module), "class_name": class_name,
                                 "cases_file": str(cases_file),
                                 "socket": str(sock_path if role == "proof" else timer_sock),
                                 "token": tokens[role], "device": device, "graph_below_s": GRAPH_BELOW_S,
                                 "task_globals": task_globals or {}},
                    )
                    # A blank worker where one is idle (torch imported, none of this job's paths
                    # in its root until now); refilled once the timing is over.
                    role_env = {**arm_base_env, "LOOM_BENCH_ROLE": role}  # one kind per role: its pid
                    blanks[role] = (arm_spec, role_env, 1)
                    launched = await warm.start(arm_spec, pool_dir, base_env=role_env,
                                                blank=use_blanks, refill=False)
                    launchers[role] = launched.process.pid
                    arm_results[role] = await supervise(launched)
                    if not startup["done"]:  # it ended before the benchmark started: stop waiting
                        startup["scope"].cancel()

                await say("preparing rotated input sets; starting both arms" if block == 0 else
                          f"block {block + 1}: fresh timer and arms")
                begun, began_epoch = time.monotonic(), time.time()
                async with anyio.create_task_group() as tg:
                    if block == 0:
                        tg.start_soon(prepare)
                    for role in [*arms_spec, "timer"]:
                        tg.start_soon(launch, role)
                    arms: dict[str, ArmConnection] = {}
                    expected = {"timer"} | ({"proof"} if "proof" in arms_spec else set())
                    try:
                        with startup["scope"], anyio.fail_after(min(timeout_s, 300)):
                            while len(arms) < len(expected):
                                stream = await listener.accept()
                                conn = ArmConnection(stream, "?")
                                try:  # whoever connects is not trusted until its token matches
                                    hello = json.loads(await conn.reader.receive_until(b"\n", 1 << 16))
                                except (ValueError, anyio.EndOfStream, anyio.IncompleteRead,
                                        anyio.BrokenResourceError, anyio.DelimiterNotFound):
                                    hello = None
                                claimed = hello.get("role") if isinstance(hello, dict) else None
                                if not isinstance(hello, dict) or claimed not in expected or not (
                                        secrets.compare_digest(str(hello.get("hello")), tokens[claimed])):
                                    await stream.aclose()
                                    continue
                                conn.role = hello["role"]
                                if hello.get("error"):
                                    raise ArmError(conn.role, hello["error"])
                                arms[conn.role] = conn
                            await arms["timer"].ask({"op": "wait_arms"}, timeout_s)
                        if startup["scope"].cancelled_caught:
                            role, job = next((r, j) for r, j in arm_results.items() if not j.ok)
                            raise ArmError(role, f"its process {job.failure()}")
                        startup["done"] = True
                        arms_ready = time.monotonic() - begun
                        if "proof" in arms:
                            # Its profiler's start-up (seconds of CUPTI) and its load overlap the
                            # others' load and the timing; both replies are read after the timing.
                            with contextlib.suppress(ArmError):  # a dead one: said after the timing
                                await arms["proof"].send({"op": "trace_start"})
                        with anyio.fail_after(timeout_s):
                            await prepared.wait()
                        inputs_ready = time.monotonic() - begun
                        prep = prep_box["job"]
                        if not prep.ok or not prep.result or prep.result.get("error"):
                            detail = (prep.result or {}).get("error") or prep.stderr_tail[-1500:]
                            raise LoomError(ErrorCode.BAD_INPUT,
                                            f"the task could not prepare benchmark inputs: {detail}")
                        if block == 0:
                            shape_meta.extend(prep.result["shapes"])
                        samples.update({m["name"]: {"a": [], "b": [], "throttled": []} for m in shape_meta})
                        await arms["timer"].ask({"op": "load"}, timeout_s)  # it loads its arms
                        if "proof" in arms:
                            with contextlib.suppress(ArmError):
                                await arms["proof"].send({"op": "load"})
                        if wall_clock and hasattr(os, "sched_setaffinity"):
                            cpus = sorted(os.sched_getaffinity(0))
                            pinned = await anyio.to_thread.run_sync(
                                pin_to_cpu, [launchers[r] for r in ("baseline", "candidate")
                                             if r in launchers], cpus[block % len(cpus)])
                            log.info("benchmark %s block %d: %d arm threads pinned to CPU %d",
                                     benchmark_id, block, pinned, cpus[block % len(cpus)])
                        log.info("benchmark %s block %d: arms ready %.2f s, inputs ready %.2f s (%s), loaded %.2f s",
                                 benchmark_id, block, arms_ready, inputs_ready,
                                 prep.timeline(began_epoch) if block == 0 else "prepared before",
                                 time.monotonic() - begun)
                        outcome["proof"] = await _run_pairs(
                            arms, shape_meta, samples, block_gate, timeout_s, clock_sampler, findings,
                            say, declared, launchers.get("candidate"), first_pair=block,
                            idle_totals=idle_totals if wall_clock else None)
                    except ArmError as exc:
                        # The candidate's own processes failing is the candidate's failure (it
                        # spends a submission); the baseline's or the timer's is not.
                        code = (ErrorCode.WORKER_CRASHED if exc.role in ("candidate", "proof")
                                else ErrorCode.BAD_INPUT)
                        failure = LoomError(code, f"the {exc.role} arm failed: {exc}")
                    except TimeoutError:
                        ended = "; ".join(f"the {role} process {job.failure()}"
                                          for role, job in arm_results.items() if not job.ok)
                        failure = LoomError(ErrorCode.TIMEOUT, "a benchmark arm stopped answering"
                                            + (f" ({ended[-1500:]})" if ended else ""))
                    except Exception as exc:  # LoomError, or a bug: either way re-raised below
                        failure = exc
                    finally:
                        for conn in arms.values():
                            with anyio.move_on_after(5):
                                bye = await farewell(conn)
                                # What the candidate's audit-hook guard refused: the timer relays
                                # the candidate arm's, the proof process reports its own.
                                refused = bye.get("guard") if conn.role == "timer" else bye.get("violations")
                                findings.extend(Finding(**f) for f in guard_findings(refused))
                        # Nothing of the arms is needed past "quit": end them now instead of waiting
                        # for an interpreter with a device context (and a profiler) to wind down.
                        tg.cancel_scope.cancel()

            # Raised here, outside the task group: raised inside it while its scope was being
            # cancelled, the error was swallowed (Python 3.12) and the benchmark went on empty.
            if failure is not None:
                raise failure
        finally:
            shutil.rmtree(exchange, ignore_errors=True)  # input files and output slots: scratch
        for role, job in arm_results.items():
            if not job.ok:
                log.info("benchmark %s: the %s process %s", benchmark_id, role, job.failure())
        return samples

    samples: dict[str, dict[str, Any]] = {}
    block_count = 0
    try:
        while True:
            timed = await run_block(block_count)
            block_count += 1
            if not wall_clock:
                samples = timed
                break
            merge_block(samples, timed, block_count - 1)
            if not more_blocks_needed(block_count, block_shapes(shape_meta, samples), gate):
                break
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
        # Scratch input sets (the evidence is in the ledger), removed by name: no link followed.
        safefs.discard(prep_worker.job_dir, cases_file.name)
        if prep_worker.alive() and "job" not in prep_box:
            prep_worker.discard()  # never given its job (an arm failed first)
    graph_used, proof, proof_note, proof_applicable = outcome["proof"]
    findings.extend(busy_finding(name, cpu, wall) for name, (cpu, wall) in idle_totals.items()
                    if IdleWatch.exceeds(cpu, wall))
    if keep_warm and device != "cpu":  # on a CPU its start-up would compete with what is timed next
        warm.prewarm(prep_template, pool_dir, depth=warm.MAX_IDLE)  # on the loop's thread
    if use_blanks:
        for spec, base_env, depth in blanks.values():
            warm.refill_blanks(spec, pool_dir, base_env=base_env, depth=depth)
    shape_samples = block_shapes(shape_meta, samples) if wall_clock else [
        ShapeSamples(name=m["name"], baseline_s=samples[m["name"]]["a"],
                     candidate_s=samples[m["name"]]["b"], throttled=samples[m["name"]]["throttled"],
                     flops=m["flops"], bytes_moved=m["bytes_moved"],
                     stop_reason=samples[m["name"]].get("stop"), sampling_s=samples[m["name"]].get("seconds"))
        for m in shape_meta
    ]
    trusted_geomean = trusted_geomean_of(shape_meta, samples, gate)
    peak_bw = peak.memory_bandwidth_bytes_s if peak else None
    peak_flops = None
    if peak:
        peak_flops = peak.flops.get("bf16") or peak.flops.get("fp16") or peak.flops.get("fp32")
    stats = analyze_shapes(shape_samples, gate, peak_bandwidth=peak_bw, peak_flops=peak_flops)
    timer: TimerKind = "wall_clock" if device == "cpu" else (
        "hip_events" if peak and peak.vendor == "amd" else "cuda_events")
    if trusted_geomean is not None and stats.geomean is not None:
        flag_disagreement(trusted_geomean, stats.geomean, findings)
    evidence = BenchmarkEvidence(
        benchmark_id=benchmark_id, device=timer_device, timer=timer, shapes=stats.shapes,
        geomean=stats.geomean, throttled_samples_dropped=stats.throttled_samples_dropped,
        outliers_dropped=stats.outliers_dropped, l2_flushed=flush_bytes > 0,
        bracket_overhead_s={m["name"]: samples[m["name"]].get("overhead", 0.0) for m in shape_meta},
        trusted_geomean=trusted_geomean,
        graph_replay=graph_used, proof_of_execution=proof, proof_note=proof_note,
        proof_applicable=proof_applicable, findings=unique_findings(findings),
        blocks=block_count if wall_clock else None, block_geomeans=stats.block_geomeans,
    )
    return evidence, evidence.findings

async def _run_pairs(arms, shape_meta, samples, gate: GateConfig, timeout_s, clock_sampler,
                     findings: list[Finding], say, declared: set[str], candidate_pid: int | None,
                     first_pair: int = 0, idle_totals: dict[str, list[float]] | None = None):
    from loom_mcp.bench.stats import paired_stop_reason

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
        idle = IdleWatch(candidate_pid) if candidate_pid else None
        late = 0  # calls whose work was done before the timer could queue its end event
        raw: dict[str, list[float]] = {"baseline": [], "candidate": []}
        lateness: dict[str, list[bool]] = {"baseline": [], "candidate": []}
        overhead: list[float] = []
        while True:
            probe = [secrets.randbelow(1 << 30) for _ in range(32)]
            salt = secrets.randbelow(1 << 30)
            before = clock_sampler() if clock_sampler else None
            # ABBA, and a block that starts with the other arm: order effects cancel across blocks.
            order = (["baseline", "candidate"] if (pair + first_pair) % 2 == 0
                     else ["candidate", "baseline"])
            got: dict[str, Any] = {"arms": {}}
            for role in order:
                # One arm's pass at a time, so the server can see what the idle candidate does
                # while the baseline is timed.
                watching = role == "baseline" and idle is not None
                if watching:  # a /proc scan: off the event loop
                    assert idle is not None  # watching implies it
                    cpu_before = await anyio.to_thread.run_sync(idle.cpu_s)
                    wall_before = time.monotonic()
                part = await arms["timer"].ask({"op": "batch", "order": [role], "salt": salt,
                                                "probe": probe, "empties": EMPTY_CALLS}, timeout_s)
                if watching:
                    wall = time.monotonic() - wall_before
                    assert idle is not None  # watching implies it
                    idle.add(await anyio.to_thread.run_sync(idle.cpu_s) - cpu_before, wall)
                got["arms"].update(part["arms"])
                got["overhead"] = got.get("overhead", []) + (part.get("overhead") or [])
                late = part.get("late", 0)
            after = clock_sampler() if clock_sampler else None
            throttled = bool((before or {}).get("throttled") or (after or {}).get("throttled"))
            base, cand = got["arms"]["baseline"], got["arms"]["candidate"]
            # Element i of both arms timed the same input set with the same content: a pair.
            raw["baseline"].extend(base["times"])
            raw["candidate"].extend(cand["times"])
            for role, arm_part in (("baseline", base), ("candidate", cand)):
                lateness[role].extend(arm_part.get("late") or [False] * len(arm_part["times"]))
            overhead.extend(got.get("overhead") or [])
            record["throttled"].extend([throttled] * len(base["times"]))
            # The timer's brackets hold its own cost (a context switch each way on a GPU, a
            # socket round trip on a CPU); the baseline's empty calls measure it.
            record["overhead"] = statistics.median(overhead) if overhead else 0.0
            kept = trusted_pairs(raw["baseline"], raw["candidate"], lateness["baseline"],
                                 lateness["candidate"])
            trusted_a = subtract_overhead([a for a, _ in kept], record["overhead"])
            trusted_b = subtract_overhead([b for _, b in kept], record["overhead"])
            if base.get("own_times") is not None and cand.get("own_times") is not None:
                # GPU: the arms' own events are the precise samples; the timer's brackets of the
                # same calls are what they are checked against (see check_own_timing).
                record["a"].extend(base["own_times"])
                record["b"].extend(cand["own_times"])
                record["trusted_a"], record["trusted_b"] = trusted_a, trusted_b
            else:
                record["a"], record["b"] = trusted_a, trusted_b
            for role in ("baseline", "candidate"):
                if got["arms"][role].get("tampered") and role not in tamper_reported:
                    tamper_reported.add(role)
                    findings.append(Finding(
                        check="benchmark.timer_tampering", severity="warning",
                        message=f"the {role} replaced harness functions while timed "
                                f"({', '.join(got['arms'][role]['tampered'])}); the timing is "
                                "taken in another process, so it changed no number"))
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
            if not agree and not mismatch_reported:
                mismatch_reported = True
                why = cand.get("error") or base.get("error") or "values differ at sampled positions"
                findings.append(Finding(
                    check="benchmark.output_mismatch", severity="error",
                    message=f"{name}: while being timed the candidate's output differs from the "
                            f"baseline's ({why}; honest only when validated?)"))
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
            findings.append(Finding(
                check="benchmark.output_mismatch", severity="error",
                message=f"{name}: while being timed {probes_off} of {probes} sampled outputs "
                        "differed from the baseline's (more than a tenth; honest only when "
                        "validated?)"))
        log.info("benchmark %s: setup %.2f s, %d pairs (%d samples per arm) in %.2f s, stopped: %s, "
                 "%d late calls", name, started - setup_started, pair, len(record["a"]), elapsed,
                 stop, late)
        await say(f"{name}: {pair} pairs done")

    proof, note = None, "proof of execution needs a GPU profiler (CPU run)"
    if not declared:
        # A candidate with no kernels of its own has nothing to prove (and no profiler starts).
        return graph_used, None, "the candidate defines no kernels of its own; nothing to prove", False
    listing: dict = {"kernels": None}
    if "proof" in arms:  # on a GPU (see benchmark_candidate)
        proof_started = time.monotonic()
        try:
            started = await arms["proof"].receive(timeout_s)  # trace_start, sent before the load
            await arms["proof"].receive(timeout_s)  # load
            listing = await arms["proof"].ask({"op": "trace", "shape": len(shape_meta) - 1}, timeout_s)
        except ArmError as exc:  # no profiler here (permissions, no CUPTI), or the process died
            note = f"no proof of execution: the proof process failed ({exc})"
        else:
            log.info("benchmark: proof-of-execution trace %.2f s after the timing (profiler start "
                     "%s, trace %s)", time.monotonic() - proof_started, started.get("seconds"),
                     listing.get("seconds"))
    if isinstance(listing.get("kernels"), list):
        seen = [str(k) for k in listing["kernels"]]
        hit = sorted(d for d in declared if any(d in k for k in seen))
        proof = bool(hit)
        note = (f"seen in the profiler trace: {', '.join(hit)}" if hit else
                f"none of {sorted(declared)} appeared among {len(seen)} kernels launched")
    return graph_used, proof, note, True
