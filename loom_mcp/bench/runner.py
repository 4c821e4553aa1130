"""benchmark: interleaved A/B timing of a candidate against a baseline, judged in the server.

The task's inputs are prepared by the trusted reference worker; two warm sandboxed arms
(baseline, candidate) connect back over a Unix socket and are timed by a trusted timer process
in ABBA order (bench/pairs.py). This module starts and ends those processes, block by block,
and turns their samples into the evidence (bench/stats.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from loom_mcp.bench.arm_procs import IdleWatch, busy_finding, pin_to_cpu
from loom_mcp.bench.arms import ArmConnection, ArmError, farewell
from loom_mcp.bench.blocks import block_shapes, merge_block, unique_findings
from loom_mcp.bench.pairs import run_pairs
from loom_mcp.bench.proof import declared_kernels
from loom_mcp.bench.stats import analyze_shapes, more_blocks_needed
from loom_mcp.bench.trusted import flag_disagreement, trusted_geomean_of
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import BenchmarkEvidence, Finding, GateConfig, TimerKind
from loom_mcp.models import DevicePeak
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobSpec, code_cache, code_cache_env, safefs, warm
from loom_mcp.sandbox.job import MODEL_JOB_ENV, REFERENCE_JOB_ENV
from loom_mcp.sandbox.runner import Progress, supervise
from loom_mcp.sandbox.sources import code_files
from loom_mcp.worker.guard import findings as guard_findings

log = logging.getLogger("loom_mcp.bench")
GRAPH_BELOW_S = 50e-6  # eager launch gaps distort kernels shorter than this: replay a graph


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
    prep_template = JobSpec(
        argv=warm.warm_argv(sys.executable, "loom_mcp.worker.reference"),
        job_dir=job_dir / "prep",
        env={**env, **REFERENCE_JOB_ENV},
        visible_devices=visible,
        timeout_s=timeout_s,
    )
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
    shm_dir = (
        Path(tempfile.mkdtemp(prefix="loom-shm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        if device != "cpu"
        else None
    )
    arms_spec = {
        "baseline": (baseline or task, "ModelNew" if baseline else "Model"),
        "candidate": (candidate, "ModelNew"),
    }

    def arm_code(role: str, module: Path) -> list[Path]:
        """What an arm may read of its module's directory: the task's whole directory for the
        task's own Model (the human's), a candidate's file and its declared sources only."""
        return [module.parent] if role == "baseline" and baseline is None else code_files(module)

    # Kernels the candidate or a Python source it declares defines: the proof looks for them.
    declared = {
        k for path in code_files(candidate) for k in declared_kernels(safefs.read_resolved_text(path, errors="replace"))
    }
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
    block_gate = (
        gate.model_copy(
            update={
                "min_time_s": min(gate.min_time_s, gate.wall_clock_block_time_s),
                "max_time_s": gate.wall_clock_block_time_s,
            }
        )
        if wall_clock
        else gate
    )
    outcome: dict[str, Any] = {"proof": (False, None, None, True)}
    idle_totals: dict[str, list[float]] = {}  # wall clock: per shape, over all blocks

    async def prepare() -> None:
        # Runs while the arms start: their imports and device setup overlap it.
        prep_box["job"] = await warm.run_warm(
            prep_worker,
            {
                "mode": "prepare_bench",
                "task": str(task),
                "shapes": shapes,
                "cases_file": str(cases_file),
                "max_sets": 2,
                "device": device,
                "task_globals": task_globals or {},
            },
            secret_env={"LOOM_NONCE": str(secrets.randbits(62))},
            timeout_s=timeout_s,
            on_progress=progress,
        )
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
        for sub in ("in-baseline", "in-candidate", "out-baseline", "out-candidate"):
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
                            argv=[sys.executable, "-m", "loom_mcp.worker.timer"],
                            job_dir=where / role,
                            # TMPDIR: torch's shared-memory manager socket, which the arms connect to
                            env={**env, "TMPDIR": str(sock_dir), **timer_role},
                            visible_devices=visible,
                            timeout_s=timeout_s,
                            writable=[sock_dir, exchange],
                            # the task's directory: it draws fresh input sets with get_inputs
                            readable=[prep_worker.job_dir, Path(task).parent],
                            shm_dir=shm_dir,
                            request={
                                "socket": str(sock_path),
                                "arms_socket": str(timer_sock),
                                "token": tokens["timer"],
                                "arm_tokens": {r: tokens[r] for r in ("baseline", "candidate")},
                                "cases_file": str(cases_file),
                                "device": device,
                                "flush_bytes": flush_bytes,
                                "rotate_bytes": flush_bytes,
                                "max_sets": 8,
                                "exchange": str(exchange),
                                "task": str(task),
                                "task_globals": task_globals or {},
                            },
                        )
                        blanks["timer"] = (timer_spec, {**env, **timer_role}, 1)
                        launched = await warm.start(
                            timer_spec, pool_dir, base_env={**env, **timer_role}, blank=use_blanks, refill=False
                        )
                        arm_results[role] = await supervise(launched)
                        if not startup["done"]:
                            startup["scope"].cancel()
                        return
                    module, class_name = arms_spec[role]
                    cache = code_cache(job_dir, Path(module))
                    slots = [exchange / f"out-{role}"] if role != "proof" else []
                    inputs = [exchange / f"in-{role}"] if role != "proof" else []
                    arm_spec = JobSpec(
                        argv=[sys.executable, "-m", "loom_mcp.worker.bench"],
                        job_dir=where / role,
                        env={**arm_base_env, "LOOM_BENCH_ROLE": role, **code_cache_env(cache)},
                        writable=[cache, *slots],
                        visible_devices=visible,
                        # read-only: an arm may connect to the sockets there, never replace one
                        # its own input files only: see the timer's setup
                        readable=[*arm_code(role, Path(module)), prep_worker.job_dir, sock_dir, *inputs],
                        shm_dir=shm_dir,
                        timeout_s=timeout_s,
                        request={
                            "role": role,
                            "module": str(module),
                            "class_name": class_name,
                            "cases_file": str(cases_file),
                            "socket": str(sock_path if role == "proof" else timer_sock),
                            "token": tokens[role],
                            "device": device,
                            "graph_below_s": GRAPH_BELOW_S,
                            "task_globals": task_globals or {},
                        },
                    )
                    # A blank worker where one is idle (torch imported, none of this job's paths
                    # in its root until now); refilled once the timing is over.
                    role_env = {**arm_base_env, "LOOM_BENCH_ROLE": role}  # one kind per role: its pid
                    blanks[role] = (arm_spec, role_env, 1)
                    launched = await warm.start(arm_spec, pool_dir, base_env=role_env, blank=use_blanks, refill=False)
                    launchers[role] = launched.process.pid
                    arm_results[role] = await supervise(launched)
                    if not startup["done"]:  # it ended before the benchmark started: stop waiting
                        startup["scope"].cancel()

                await say(
                    "preparing rotated input sets; starting both arms"
                    if block == 0
                    else f"block {block + 1}: fresh timer and arms"
                )
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
                                except (
                                    ValueError,
                                    anyio.EndOfStream,
                                    anyio.IncompleteRead,
                                    anyio.BrokenResourceError,
                                    anyio.DelimiterNotFound,
                                ):
                                    hello = None
                                claimed = hello.get("role") if isinstance(hello, dict) else None
                                if (
                                    not isinstance(hello, dict)
                                    or claimed not in expected
                                    or not (secrets.compare_digest(str(hello.get("hello")), tokens[claimed]))
                                ):
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
                            raise LoomError(
                                ErrorCode.BAD_INPUT, f"the task could not prepare benchmark inputs: {detail}"
                            )
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
                                pin_to_cpu,
                                [launchers[r] for r in ("baseline", "candidate") if r in launchers],
                                cpus[block % len(cpus)],
                            )
                            log.info(
                                "benchmark %s block %d: %d arm threads pinned to CPU %d",
                                benchmark_id,
                                block,
                                pinned,
                                cpus[block % len(cpus)],
                            )
                        log.info(
                            "benchmark %s block %d: arms ready %.2f s, inputs ready %.2f s (%s), loaded %.2f s",
                            benchmark_id,
                            block,
                            arms_ready,
                            inputs_ready,
                            prep.timeline(began_epoch) if block == 0 else "prepared before",
                            time.monotonic() - begun,
                        )
                        outcome["proof"] = await run_pairs(
                            arms,
                            shape_meta,
                            samples,
                            block_gate,
                            timeout_s,
                            clock_sampler,
                            findings,
                            say,
                            declared,
                            launchers.get("candidate"),
                            first_pair=block,
                            idle_totals=idle_totals if wall_clock else None,
                        )
                    except ArmError as exc:
                        # The candidate's own processes failing is the candidate's failure (it
                        # spends a submission); the baseline's or the timer's is not.
                        code = ErrorCode.WORKER_CRASHED if exc.role in ("candidate", "proof") else ErrorCode.BAD_INPUT
                        failure = LoomError(code, f"the {exc.role} arm failed: {exc}")
                    except TimeoutError:
                        ended = "; ".join(
                            f"the {role} process {job.failure()}" for role, job in arm_results.items() if not job.ok
                        )
                        failure = LoomError(
                            ErrorCode.TIMEOUT,
                            "a benchmark arm stopped answering" + (f" ({ended[-1500:]})" if ended else ""),
                        )
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
    findings.extend(
        busy_finding(name, cpu, wall) for name, (cpu, wall) in idle_totals.items() if IdleWatch.exceeds(cpu, wall)
    )
    if keep_warm and device != "cpu":  # on a CPU its start-up would compete with what is timed next
        warm.prewarm(prep_template, pool_dir, depth=warm.MAX_IDLE)  # on the loop's thread
    if use_blanks:
        for spec, base_env, depth in blanks.values():
            warm.refill_blanks(spec, pool_dir, base_env=base_env, depth=depth)
    shape_samples = block_shapes(shape_meta, samples)
    trusted_geomean = trusted_geomean_of(shape_meta, samples, gate)
    lenient_geomean = trusted_geomean_of(shape_meta, samples, gate, key="trusted_b_lenient")
    peak_bw = peak.memory_bandwidth_bytes_s if peak else None
    peak_flops = None
    if peak:
        peak_flops = peak.flops.get("bf16") or peak.flops.get("fp16") or peak.flops.get("fp32")
    stats = analyze_shapes(shape_samples, gate, peak_bandwidth=peak_bw, peak_flops=peak_flops)
    timer: TimerKind = (
        "wall_clock" if device == "cpu" else ("hip_events" if peak and peak.vendor == "amd" else "cuda_events")
    )
    if trusted_geomean is not None and stats.geomean is not None:
        flag_disagreement(trusted_geomean, stats.geomean, findings, lenient_geomean)
    evidence = BenchmarkEvidence(
        **dict(stats),  # the statistics of the samples as they are; the rest is what this run knew
        benchmark_id=benchmark_id,
        device=timer_device,
        timer=timer,
        l2_flushed=flush_bytes > 0,
        graph_replay=graph_used,
        bracket_overhead_s={m["name"]: samples[m["name"]].get("overhead", 0.0) for m in shape_meta},
        trusted_geomean=trusted_geomean,
        proof_of_execution=proof,
        proof_note=proof_note,
        proof_applicable=proof_applicable,
        findings=unique_findings(findings),
        blocks=block_count if wall_clock else None,
    )
    return evidence, evidence.findings
