"""The judge's services: compile, validate and benchmark a candidate on a device of this server.

Plain async functions over the config, ledger and artifact store; the MCP layer only calls them.
Every job that touches a device takes a slot of the pool and holds its lease (dispatch.py); the
held time is the call's device seconds. Full records, with where each ran, are stored as
artifacts and indexed in the ledger (loom://runs/{id}).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson

from loom_mcp.bench.runner import benchmark_candidate
from loom_mcp.compile.service import Language, compile_source
from loom_mcp.config import LoomConfig
from loom_mcp.devices.toolchain import probe_toolchain
from loom_mcp.dispatch import Leased, Target, campaign_kind, pick_target, run_on_ray, targets_of_kind
from loom_mcp.dispatch import first_visible as first_visible  # where tests and scripts look for it
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.executor.ray_executor import build_job
from loom_mcp.gate import benchmark_reasons, review_explanation
from loom_mcp.judge_models import (
    BenchmarkEvidence,
    Finding,
    GateConfig,
    ValidationCase,
    ValidationEvidence,
    is_review_code,
)
from loom_mcp.models import (
    BenchmarkResult,
    CaseSummary,
    CheckFinding,
    CompileResult,
    RunValidationResult,
    ShapeSpeed,
)
from loom_mcp.sandbox import policy, safefs
from loom_mcp.sandbox.runner import Progress
from loom_mcp.sandbox.sources import code_digest, code_files, snapshot
from loom_mcp.store import ArtifactStore, Ledger, new_run_id
from loom_mcp.validate.runner import validate_candidate
from loom_mcp.validate.taskfile import check_task_globals, parse_task_source


def validation_reuse_key(
    config: LoomConfig,
    target: Target,
    task: Path,
    candidate: Path,
    seeds: int,
    shapes: list[str] | None,
    task_globals: dict[str, Any] | None = None,
) -> str:
    """Everything a validation verdict depends on: the two files' bytes, the task's global
    overrides, the seeds and shapes, the device (by identity, not just model) and driver, the
    software, and the gate policy. Evidence is reused only when all of it is equal."""
    device = target.device
    material = {
        "task": hashlib.sha256(safefs.read_resolved_bytes(task)).hexdigest(),
        "candidate": code_digest(candidate),  # with its declared SOURCES
        "seeds": seeds,
        "shapes": sorted(shapes) if shapes else None,
        "device": [target.torch_device, device.vendor, device.name, device.uuid, device.driver_version],
        "software": target.software,
        "policy": config.fingerprint(),
    }
    if task_globals:  # absent when none, so keys of runs without overrides stay as they were
        material["task_globals"] = task_globals
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()


async def reusable_validation(
    config: LoomConfig,
    ledger: Ledger,
    artifacts: ArtifactStore,
    *,
    task: Path,
    candidate: Path,
    task_globals: dict[str, Any] | None = None,
    campaign_id: str | None = None,
) -> tuple[str, ValidationEvidence] | None:
    """A full validation (policy seeds, every shape) already run on these exact bytes here, on
    any device of the kind the job would run on (the campaign's).

    Only when every such run passed: each run draws fresh secret seeds, so a candidate that
    fails some of them must not be able to fish for one lucky pass and submit on it."""
    overrides = checked_task_globals(task, task_globals)
    rows: list[dict[str, Any]] = []
    for target in await targets_of_kind(config, campaign_kind(ledger, artifacts, campaign_id)):
        key = validation_reuse_key(config, target, task, candidate, config.gate.seeds, None, overrides)
        rows += ledger.runs_with_key("validation", key)
    rows.sort(key=lambda r: r["created_at"], reverse=True)
    if not rows or not all(orjson.loads(r["summary_json"]).get("passed") for r in rows):
        return None
    row = rows[0]
    record = orjson.loads(artifacts.get_bytes(row["record_sha"]))
    return row["id"], ValidationEvidence.model_validate(record["evidence"])


def check_file(config: LoomConfig, path: str, what: str) -> Path:
    """`path` resolved once and checked against the allowed roots: a regular file reached through
    no symlink. Callers read the returned path with safefs.read_resolved_*, which refuse it
    should a component have become a symlink since."""
    resolved = config.check_allowed(Path(path), what)
    try:
        return safefs.check_resolved_file(resolved, safefs.MAX_SOURCE_BYTES)
    except LoomError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            raise LoomError(ErrorCode.NOT_FOUND, f"{what} file {resolved} does not exist") from None
        raise


def checked_task_globals(task_path: Path, task_globals: dict[str, Any] | None) -> dict[str, Any]:
    """The call's task_globals checked against the task file's module-level names (sorted)."""
    if not task_globals:
        return {}
    return check_task_globals(safefs.read_resolved_text(task_path), str(task_path), task_globals)


def _finding(f: Finding) -> CheckFinding:
    return CheckFinding(check=f.check, severity=f.severity, message=f.message, where=f.where)


def store_record(
    ledger: Ledger,
    artifacts: ArtifactStore,
    run_id: str,
    kind: str,
    record: Any,
    summary: Any,
    campaign_id: str | None,
    reuse_key: str | None = None,
) -> None:
    payload = orjson.dumps(record.model_dump() if hasattr(record, "model_dump") else record)
    sha = artifacts.put_bytes(payload, kind=f"{kind}-record", name=f"{run_id}.json")
    ledger.insert_run(run_id, kind, sha, summary.model_dump(), campaign_id, reuse_key=reuse_key)


@dataclass
class JudgeCall:
    """What a validation or a benchmark judges, the same for both: the task and the candidate
    (paths as the caller gave them), the task's shapes and globals, the campaign the run is
    recorded under, and where progress messages go."""

    task: str
    candidate: str
    shapes: list[str] | None = None  # None: every shape
    campaign_id: str | None = None
    progress: Progress | None = None
    task_globals: dict[str, Any] | None = None

    def checked(self, config: LoomConfig) -> tuple[Path, Path, dict[str, Any]]:
        """The task and candidate files checked against the allowed roots, and the task_globals
        checked against the task's module-level names."""
        task_path = check_file(config, self.task, "task")
        cand_path = check_file(config, self.candidate, "candidate")
        return task_path, cand_path, checked_task_globals(task_path, self.task_globals)


def _placement(target: Target) -> dict[str, Any] | None:
    """Where the run ran (executor, node, slot, kind, queue wait), for its record."""
    return target.placement.model_dump() if target.placement else None


def _held_for(target: Target) -> float:
    """Device seconds of a job run elsewhere (a GPU's, as Leased counts them; 0 on a CPU)."""
    p = target.placement
    return (p.ended_at or p.started_at) - p.started_at if p and target.is_gpu else 0.0


def _job_limits(config: LoomConfig) -> tuple[int, int]:
    """The sandbox limits a job runs under, wherever it runs (memory, disk bytes)."""
    limits = policy.from_config(config)
    return limits.memory_bytes, limits.disk_bytes


# ---------------------------------------------------------------- compile


async def compile_kernel(
    config: LoomConfig,
    artifacts: ArtifactStore,
    *,
    source: str,
    language: Language,
    target: str | None,
    flags: list[str],
    task: str | None,
    progress: Progress | None,
    task_globals: dict[str, Any] | None = None,
) -> tuple[CompileResult, float]:
    src = check_file(config, source, "source")
    task_path = check_file(config, task, "task") if task else None
    task_globals = checked_task_globals(task_path, task_globals) if task_path else None
    toolchain = await probe_toolchain(config.cache_dir / "toolchain.json")

    async def run(device: str, target: str | None) -> CompileResult:
        return await compile_source(
            config,
            artifacts,
            toolchain,
            source=src,
            language=language,
            target=target,
            flags=flags,
            task=task_path,
            device=device,
            progress=progress,
            task_globals=task_globals,
        )

    if language != "triton":  # nvcc/hipcc compile for a named target without touching a device
        return await run("cpu", target), 0.0
    tgt = await pick_target(config)
    if target is None and tgt.is_gpu and tgt.device.arch:
        target = tgt.device.arch
    async with Leased(config, tgt, progress) as held:
        result = await run(held.target.torch_device, target)
    return result, held.seconds


# ---------------------------------------------------------------- validation


def summarize_validation(evidence: ValidationEvidence, device: str, seeds: int, seconds: float) -> RunValidationResult:
    failing = [c for c in evidence.cases if not c.passed]
    # The worst failing case when any fails (a passing one would read as "all is well"):
    # the largest relative error among them, else the first (a shape or type failure has none).
    worst: ValidationCase | None
    if failing:
        measured = [c for c in failing if c.max_rel_err is not None]
        worst = max(measured, key=lambda c: c.max_rel_err or 0.0) if measured else failing[0]
    else:
        passing = [c for c in evidence.cases if c.max_rel_err is not None]
        worst = max(passing, key=lambda c: c.max_rel_err or 0.0, default=None)

    def summary(c: ValidationCase) -> CaseSummary:
        # Every field the summary has is the case's own, but the message is cut short.
        same = c.model_dump(include=set(CaseSummary.model_fields) - {"message"})
        return CaseSummary(**same, message=(c.message or "")[:300] or None)

    shapes = list(dict.fromkeys(c.shape for c in evidence.cases))
    if evidence.passed:
        next_step = "benchmark(task, candidate) to measure the speedup"
    else:
        next_step = "fix what the findings name and run_validation again"
    return RunValidationResult(
        validation_id=evidence.validation_id,
        passed=evidence.passed,
        device=device,
        shapes=shapes,
        seeds_per_shape=seeds,
        cases_total=len(evidence.cases),
        cases_failed=len(failing),
        failing_cases=[summary(c) for c in failing[:8]],
        worst_case=summary(worst) if worst else None,
        findings=[_finding(f) for f in evidence.findings][:12],
        seconds=round(seconds, 3),
        next_step=next_step,
    )


async def run_validation(
    config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, call: JudgeCall, seeds: int | None = None
) -> tuple[RunValidationResult, ValidationEvidence, float]:
    task_path, cand_path, task_globals = call.checked(config)
    seeds = max(seeds or config.gate.seeds, config.gate.seeds)  # more seeds than policy, never fewer
    kind = campaign_kind(ledger, artifacts, call.campaign_id)
    default = await pick_target(config)  # no torch: TOOLCHAIN_MISSING before anything is written
    run_id = new_run_id("validation")
    started = time.monotonic()
    # The job runs a server-owned copy; the key and the record are of the same bytes.
    ran = await anyio.to_thread.run_sync(snapshot, cand_path, config.jobs_dir / run_id / "code")
    if config.executor.kind == "ray":
        settings = {
            "seeds": seeds,
            "shapes": call.shapes,
            "timeout_s": config.job_timeout_s,
            "validation_id": run_id,
            "task_globals": task_globals,
        }
        job = build_job("validate", run_id, task_path, ran, code_files(ran), settings, *_job_limits(config))
        remote, target = await run_on_ray(config, default, kind, job, call.progress)
        evidence = ValidationEvidence.model_validate(remote.evidence)
        reuse_key = validation_reuse_key(config, target, task_path, ran, seeds, call.shapes, task_globals)
        device_seconds = _held_for(target)
    else:
        async with Leased(config, default, call.progress, kind) as held:
            target = held.target  # the slot that came free
            reuse_key = validation_reuse_key(config, target, task_path, ran, seeds, call.shapes, task_globals)
            evidence = await validate_candidate(
                task=task_path,
                candidate=ran,
                job_dir=config.jobs_dir / run_id,
                seeds=seeds,
                shapes=call.shapes,
                device=target.torch_device,
                timeout_s=config.job_timeout_s,
                validation_id=run_id,
                keep_warm=config.warm_workers,
                progress=call.progress,
                task_globals=task_globals,
            )
        device_seconds = held.seconds
    result = summarize_validation(evidence, target.torch_device, seeds, time.monotonic() - started)
    store_record(
        ledger,
        artifacts,
        run_id,
        "validation",
        {
            "evidence": evidence.model_dump(),
            "task": str(task_path),
            "task_globals": task_globals,
            "candidate": str(cand_path),
            "candidate_sha": artifacts.put_bytes(safefs.read_resolved_bytes(ran), "candidate", cand_path.name),
            "reuse_key": reuse_key,
            "placement": _placement(target),
        },
        result,
        call.campaign_id,
        reuse_key=reuse_key,
    )
    return result, evidence, device_seconds


# ---------------------------------------------------------------- benchmark


def flush_bytes_for(target: Target) -> int:
    """A buffer well past the last-level cache: 2x the L2 when known, else 256 MiB (do_bench's).

    None on CPU: a host-side flush also evicts the interpreter's own state, so every call paid
    ~200 us of cold misses and small shapes measured the flush, not the kernel (seen on the
    2-core CI machine). CPU timings are wall-clock, warm-cache, and labelled as such."""
    if not target.is_gpu:
        return 0
    l2 = target.device.peak.l2_bytes if target.device.peak else None
    return max(2 * l2, 256 << 20) if l2 else 256 << 20


# What a benchmark's result reports of its evidence unchanged (the same name in both).
def _sig(value: Any, digits: int = 4) -> Any:
    """A figure to `digits` significant digits, for a tool result an agent reads: seventeen
    digits a float made a CPU benchmark's result pass 4 KB. The evidence keeps every digit."""
    return None if value is None else float(f"{value:.{digits}g}")


_EVIDENCE_AS_IS = {
    "benchmark_id",
    "device",
    "timer",
    "l2_flushed",
    "graph_replay",
    "throttled_samples_dropped",
    "proof_of_execution",
    "proof_note",
    "blocks",
    "block_geomeans",
}


def summarize_benchmark(
    evidence: BenchmarkEvidence,
    findings: list[Finding],
    gate: GateConfig,
    seconds: float,
    device_state: dict | None,
    baseline: str = "the task's Model",
    validation: ValidationEvidence | None = None,
) -> BenchmarkResult:
    shapes = [
        ShapeSpeed(
            name=s.name,
            baseline_median_s=_sig(s.baseline.median),
            candidate_median_s=_sig(s.candidate.median),
            speedup=_sig(s.ratio.estimate),
            ci_low=_sig(s.ratio.ci_low),
            ci_high=_sig(s.ratio.ci_high),
            pairs=min(s.baseline.n, s.candidate.n),
            candidate_cv=_sig((s.candidate.std / s.candidate.mean) if s.candidate.mean else 0.0),
            floor_s=_sig(s.floor_s),
            roofline_fraction=_sig(s.roofline_fraction),
            stop_reason=s.stop_reason,
            block_speedups=[_sig(r) for r in s.block_ratios] if s.block_ratios is not None else None,
            output_deviation=_sig(s.output_deviation),
        )
        for s in evidence.shapes
    ]
    g = evidence.geomean
    overhead = max((evidence.bracket_overhead_s or {}).values(), default=None)
    trusted = evidence.trusted_geomean
    if trusted is not None:
        note = (
            "the arms' own device events, checked against a trusted process's bracket of "
            f"every call ({trusted.estimate:.3f}x [{trusted.ci_low:.3f}, {trusted.ci_high:.3f}])"
        )
    else:
        note = "timed by a trusted process that runs no code under test" + (
            f"; its bracket's own cost ({overhead * 1e6:.1f} us a call) is subtracted" if overhead else ""
        )
    if evidence.timer == "wall_clock":
        note = "CPU wall-clock timings, one thread per arm (no GPU here): they say nothing about GPU speed; " + note
        if evidence.blocks:
            note += f"; {evidence.blocks} blocks of fresh processes, the CI a t-interval across the blocks' ratios"
    if any(f.severity == "error" for f in findings):
        next_step = "the candidate misbehaved while timed; fix the findings, then run_validation again"
    else:
        next_step = benchmark_advice(evidence, gate, validation)
    as_is = evidence.model_dump(include=_EVIDENCE_AS_IS)
    if as_is.get("block_geomeans") is not None:
        as_is["block_geomeans"] = [_sig(r) for r in as_is["block_geomeans"]]
    return BenchmarkResult(
        **as_is,
        timer_note=note,
        shapes=shapes,
        geomean_speedup=_sig(g.estimate) if g else None,
        geomean_ci_low=_sig(g.ci_low) if g else None,
        geomean_ci_high=_sig(g.ci_high) if g else None,
        ci_level=gate.ci_level,
        findings=[_finding(f) for f in findings],
        device_state=device_state,
        seconds=round(seconds, 3),
        baseline=baseline,
        next_step=next_step,
    )


def benchmark_advice(
    evidence: BenchmarkEvidence, gate: GateConfig, validation: ValidationEvidence | None = None
) -> str:
    """The next step after a benchmark, from the rules the gate will apply to it on submit (with
    a passed validation of the same bytes, if there is one, for the rules that read it)."""
    reasons = benchmark_reasons(evidence, gate, validation)
    codes = {c for c, _ in reasons}
    blocking = [(c, m) for c, m in reasons if not is_review_code(c)]
    if "benchmark.output_drift" in codes:  # before any speed: the timed code is not what passed
        drift = [m for c, m in blocking if c == "benchmark.output_drift"]
        return (
            "do not submit: the gate rejects this. "
            + " ".join(drift)
            + " Compute the same way whether timed or not, then run_validation and benchmark again"
        )
    if "shape.regression" in codes:
        slow = [m for c, m in blocking if c == "shape.regression"]
        return (
            "do not submit yet: the gate rejects a candidate with any shape clearly slower "
            f"(CI upper bound below {1 - gate.max_regression:.3f}x). {' '.join(slow)} Make that "
            "shape at least as fast as the baseline (e.g. a separate path or tuning for it), "
            "then benchmark again"
        )
    if "speedup.insufficient" in codes:
        g = evidence.geomean
        low = f"{g.ci_low:.3f}x" if g else "unknown"
        return (
            f"not a clear win yet: the geomean CI lower bound ({low}) must exceed "
            f"{1 + gate.min_gain:.3f}x for the gate to accept; profile the candidate or try a "
            "different approach (re-running the same idea only chases noise)"
        )
    if blocking:
        return (
            "the gate would reject this evidence: "
            + " ".join(m for _, m in blocking)
            + " Fix that, then benchmark again"
        )
    if reasons:
        return (
            "submit_candidate would end in needs_review, not accept ("
            + review_explanation([c for c, _ in reasons])
            + ")"
        )
    return "submit_candidate to have the server re-check and accept it"


def _clock_sampler(target: Target):
    if target.device.vendor == "nvidia":
        from loom_mcp.devices.nvidia import sample_clocks

        return lambda: sample_clocks(target.device.index)
    if target.device.vendor == "amd":
        from loom_mcp.devices.amd import sample_clocks_amd

        return lambda: sample_clocks_amd(target.device.index)
    return None


def task_baseline(task_path: Path) -> str | None:
    """The task's own BASELINE file, if it names one: what to time when the caller names no
    baseline, because some tasks' Model is a correctness oracle (a CPU float64 reference)
    whose speed means nothing."""
    # The resolved, checked path, read without following a link swapped in since (read_task
    # would open it by name).
    name = parse_task_source(safefs.read_resolved_text(task_path), str(task_path)).baseline
    return str(task_path.parent / name) if name else None


async def run_benchmark(
    config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, call: JudgeCall, baseline: str | None = None
) -> tuple[BenchmarkResult, BenchmarkEvidence, list[Finding], float]:
    task_path, cand_path, task_globals = call.checked(config)
    if not baseline:
        baseline = task_baseline(task_path)
    base_path = check_file(config, baseline, "baseline") if baseline else None
    kind = campaign_kind(ledger, artifacts, call.campaign_id)
    gate = config.gate
    run_id = new_run_id("benchmark")
    started = time.monotonic()
    default = await pick_target(config)
    if config.executor.kind == "ray":
        settings = {
            "shapes": call.shapes,
            "flush_bytes": flush_bytes_for(default),  # a kind's devices share their caches' sizes
            "timeout_s": config.job_timeout_s,
            "benchmark_id": run_id,
            "task_globals": task_globals,
            "gate": gate.model_dump(mode="json"),
            "peak": default.device.peak.model_dump(mode="json") if default.device.peak else None,
        }
        job = build_job(
            "benchmark", run_id, task_path, cand_path, code_files(cand_path), settings, *_job_limits(config), base_path
        )
        remote, target = await run_on_ray(config, default, kind, job, call.progress)
        evidence = BenchmarkEvidence.model_validate(remote.evidence)
        findings = [Finding.model_validate(f) for f in remote.findings]
        before, after = remote.clocks_before, remote.clocks_after
        device_seconds = _held_for(target)
    else:
        # The two arms, the timer and the proof share the one slot the lease holds.
        async with Leased(config, default, call.progress, kind) as held:
            target = held.target
            sampler = _clock_sampler(target)
            before = sampler() if sampler else None
            evidence, findings = await benchmark_candidate(
                task=task_path,
                candidate=cand_path,
                baseline=base_path,
                job_dir=config.jobs_dir / run_id,
                shapes=call.shapes,
                device=target.torch_device,
                gate=gate,
                peak=target.device.peak,
                flush_bytes=flush_bytes_for(target),
                timeout_s=config.job_timeout_s,
                benchmark_id=run_id,
                clock_sampler=sampler,
                keep_warm=config.warm_workers,
                progress=call.progress,
                task_globals=task_globals,
            )
            after = sampler() if sampler else None
        device_seconds = held.seconds
    state = None
    if before and after:
        state = {
            "sm_clock_mhz_before": before.get("sm_clock_mhz"),
            "sm_clock_mhz_after": after.get("sm_clock_mhz"),
            "temperature_c_after": after.get("temperature_c"),
            "power_w_after": after.get("power_w"),
        }
    # The advice applies the rules that need a validation when these bytes have a passed one here.
    validated = await reusable_validation(
        config,
        ledger,
        artifacts,
        task=task_path,
        candidate=cand_path,
        task_globals=task_globals,
        campaign_id=call.campaign_id,
    )
    result = summarize_benchmark(
        evidence,
        findings,
        gate,
        time.monotonic() - started,
        state,
        baseline=str(base_path) if base_path else "the task's Model",
        validation=validated[1] if validated else None,
    )
    store_record(
        ledger,
        artifacts,
        run_id,
        "benchmark",
        {
            "evidence": evidence.model_dump(),
            "findings": [f.model_dump() for f in findings],
            "task": str(task_path),
            "task_globals": task_globals,
            "candidate": str(cand_path),
            "baseline": str(base_path) if base_path else None,
            "device": target.device.model_dump(),
            "placement": _placement(target),
        },
        result,
        call.campaign_id,
    )
    return result, evidence, findings, device_seconds
