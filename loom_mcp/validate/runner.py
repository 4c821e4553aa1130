"""run_validation: three sandboxed processes, then a verdict on correctness built in the server.

1. `reference.prepare` (trusted task code): plans shape x seed x input-kind cases from a secret
   nonce and writes the inputs. No reference output exists yet.
2. `candidate` (untrusted): a fresh process that never imports the task; runs each case twice,
   saves its outputs.
3. `reference.compare` (trusted): regenerates the inputs from their seeds, computes the
   reference (native and float64) and compares.
The static checks read the candidate's source without running it.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import DEFAULT_TOLERANCES, Finding, ValidationCase, ValidationEvidence
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobResult, JobSpec, run_job
from loom_mcp.validate.static_checks import check_candidate_source

Progress = Callable[[str], Awaitable[None]]
log = logging.getLogger("loom_mcp.validate")


def worker_argv(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def _job_failure(name: str, job: JobResult) -> str:
    if job.timed_out:
        return f"the {name} step timed out after {job.wall_s:.0f} s"
    if job.signal:
        return f"the {name} process died with {job.signal}"
    tail = job.stderr_tail.strip().splitlines()[-6:]
    return f"the {name} process exited with {job.returncode}: " + " | ".join(tail)


async def validate_candidate(
    *,
    task: Path,
    candidate: Path,
    job_dir: Path,
    seeds: int,
    shapes: list[str] | None,
    device: str,
    timeout_s: float,
    tolerances: dict[str, Any] | None = None,
    validation_id: str,
    progress: Progress | None = None,
) -> ValidationEvidence:
    async def say(message: str) -> None:
        if progress:
            await progress(message)

    findings: list[Finding] = list(check_candidate_source(candidate.read_text(), str(candidate)))
    job_dir.mkdir(parents=True, exist_ok=True)
    device, env, visible = job_placement(device)
    tol_table = {k: v.model_dump() for k, v in DEFAULT_TOLERANCES.items()}
    tol_table.update(tolerances or {})
    cases_file = job_dir / "prep" / "cases.pt"
    outputs_file = job_dir / "cand" / "outputs.pt"

    await say("preparing inputs")
    prep = await run_job(JobSpec(
        argv=worker_argv("loom_mcp.worker.reference"), job_dir=job_dir / "prep", env=env, visible_devices=visible,
        timeout_s=timeout_s,
        request={"mode": "prepare", "task": str(task), "seeds": seeds, "shapes": shapes,
                 "nonce": secrets.randbits(62), "cases_file": str(cases_file), "device": device},
    ), on_progress=progress)
    if not prep.ok or not prep.result or prep.result.get("error"):
        detail = (prep.result or {}).get("error") or _job_failure("task", prep)
        if "unknown shape" in detail:
            raise LoomError(ErrorCode.BAD_INPUT, detail.splitlines()[0])
        raise LoomError(ErrorCode.BAD_INPUT, f"the task could not prepare inputs: {detail}")
    planned: list[dict] = prep.result["cases"]
    log.info("validation %s: prepare %.2f s (worker %.2f s)", validation_id, prep.wall_s,
             prep.result.get("seconds") or 0.0)

    await say(f"running the candidate on {len(planned)} cases")
    cand = await run_job(JobSpec(
        argv=worker_argv("loom_mcp.worker.candidate"), job_dir=job_dir / "cand", env=env, visible_devices=visible,
        timeout_s=timeout_s,
        request={"candidate": str(candidate), "cases_file": str(cases_file),
                 "outputs_file": str(outputs_file), "device": device},
    ), on_progress=progress)
    cand_result = cand.result if cand.ok and cand.result else None
    log.info("validation %s: candidate %.2f s (worker %.2f s)", validation_id, cand.wall_s,
             (cand_result or {}).get("seconds") or 0.0)
    if cand_result is None:
        findings.append(Finding(check="validation.crash", severity="error",
                                message=_job_failure("candidate", cand)))
    elif cand_result.get("load_error"):
        findings.append(Finding(check="validation.import", severity="error",
                                message="the candidate failed to import: " + cand_result["load_error"]))
    if cand_result is None or cand_result.get("load_error") or not outputs_file.exists():
        return ValidationEvidence(validation_id=validation_id, passed=False, cases=[], findings=findings)

    await say("computing the reference and comparing")
    comp = await run_job(JobSpec(
        argv=worker_argv("loom_mcp.worker.reference"), job_dir=job_dir / "ref", env=env, visible_devices=visible,
        timeout_s=timeout_s,
        request={"mode": "compare", "task": str(task), "cases": planned,
                 "digests": prep.result["digests"], "outputs_file": str(outputs_file),
                 "device": device, "tolerances": tol_table},
    ), on_progress=progress)
    if not comp.ok or not comp.result or comp.result.get("error"):
        detail = (comp.result or {}).get("error") or _job_failure("reference", comp)
        raise LoomError(ErrorCode.BAD_INPUT, f"the task's reference failed: {detail}")

    log.info("validation %s: compare %.2f s (worker %.2f s)", validation_id, comp.wall_s,
             comp.result.get("seconds") or 0.0)
    cases = build_cases(planned, cand_result["cases"], comp.result["cases"], findings)
    passed = bool(cases) and all(c.passed for c in cases) and not any(
        f.severity == "error" for f in findings)
    return ValidationEvidence(validation_id=validation_id, passed=passed, cases=cases, findings=findings)


def build_cases(planned: list[dict], ran: list[dict], compared: list[dict],
                findings: list[Finding]) -> list[ValidationCase]:
    """One ValidationCase per (case, output); behaviour checks become named findings once each."""
    cases: list[ValidationCase] = []
    seen: set[str] = set()

    def once(check: str, message: str) -> None:
        if check not in seen:
            seen.add(check)
            findings.append(Finding(check=check, severity="error", message=message))

    for plan, run, comp in zip(planned, ran, compared):
        label = f"{plan['shape']['name']} seed {plan['seed']} ({plan['kind']})"
        problems = []
        if run["error"]:
            problems.append(run["error"].splitlines()[0])
            check = "validation.output_type" if not run["output_type_ok"] else "validation.exception"
            once(check, f"{label}: {run['error']}")
        if run["aliases_input"]:
            problems.append("an output aliases an input")
            once("validation.aliasing", f"{label}: an output shares storage with an input; "
                 "return a new tensor")
        if not run["inputs_unchanged"]:
            problems.append("inputs were modified")
            once("validation.input_mutation", f"{label}: forward modified its inputs in place")
        if not run["deterministic"]:
            problems.append("rerun not bitwise identical")
            once("validation.determinism", f"{label}: a second run on the same inputs gave different "
                 "bits (uninitialised memory, a race, or atomics)")
        if run["late_write"]:
            problems.append("outputs changed after return")
            once("validation.late_write", f"{label}: outputs changed after forward returned (work on "
                 "another stream or thread)")
        if run["threads_added"] > 0:
            problems.append("left threads running")
            once("validation.threads", f"{label}: forward left {run['threads_added']} thread(s) running")
        if not comp["inputs_reproducible"]:
            once("task.nondeterministic_inputs", f"{label}: the task's get_inputs is not reproducible "
                 "from the seed; fix the task (use torch's global RNG)")
            problems.append("task inputs not reproducible")
        if comp.get("error"):
            problems.append(comp["error"].splitlines()[0])
            once("validation.outputs", f"{label}: {comp['error']}")
        if comp.get("degenerate") and "validation.degenerate" not in seen:
            seen.add("validation.degenerate")
            findings.append(Finding(check="validation.degenerate", severity="warning",
                                    message=f"{label}: the reference output is (nearly) constant; a "
                                    "constant could pass. Strengthen the task's inputs"))
        outputs = comp.get("outputs") or []
        if not outputs:
            cases.append(ValidationCase(
                shape=plan["shape"]["name"], seed=plan["seed"], input_kind=plan["kind"], atol=0, rtol=0,
                passed=False, output_type_ok=run["output_type_ok"],
                inputs_unchanged=run["inputs_unchanged"], deterministic=run["deterministic"],
                message="; ".join(problems) or "no output to compare"))
            continue
        for out in outputs:
            ok = out["passed"] and not problems
            if not out["shape_match"]:
                once("validation.shape", f"{label}: {out['message']}")
            elif not out["dtype_match"]:
                once("validation.dtype", f"{label}: {out['message']} (precision changes are not allowed)")
            elif not out["nan_inf_parity"]:
                once("validation.nan_inf", f"{label}: {out['message']}")
            elif not out["passed"]:
                once("validation.mismatch", f"{label}: {out['message']}")
            cases.append(ValidationCase(
                shape=plan["shape"]["name"], seed=plan["seed"], input_kind=plan["kind"],
                dtype=out["dtype"], max_abs_err=out["max_abs_err"], max_rel_err=out["max_rel_err"],
                mismatched=out["mismatched"], atol=out["atol"], rtol=out["rtol"], passed=ok,
                shape_match=out["shape_match"], nan_inf_parity=out["nan_inf_parity"],
                output_type_ok=run["output_type_ok"] and not run["aliases_input"],
                inputs_unchanged=run["inputs_unchanged"], deterministic=run["deterministic"],
                message="; ".join(filter(None, [out["message"], *problems])) or None))
    return cases
