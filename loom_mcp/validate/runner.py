"""run_validation: three sandboxed processes, then a verdict on correctness built in the server.

1. `reference.prepare` (trusted task code): plans shape x seed x input-kind cases from a secret
   nonce and writes the inputs. No reference output exists yet.
2. `candidate` (untrusted): a fresh process that never imports the task; runs each case twice,
   saves its outputs.
3. `reference.compare` (trusted): regenerates the inputs from their seeds and computes the
   reference (native and float64) while the candidate runs, then compares once it has exited.
All three start together so imports and device setup overlap; steps 2 and 3 wait for a go-file
signed with a token only they hold (in their environment), published when the step before them
has exited. The seed nonce travels in the environment too: files under the server's home are
readable by a candidate running as the same user, a process's environment is not.
The static checks read the candidate's source without running it.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import DEFAULT_TOLERANCES, Finding, ValidationCase, ValidationEvidence
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobResult, JobSpec, code_cache, run_job
from loom_mcp.validate.static_checks import check_candidate_source

Progress = Callable[[str], Awaitable[None]]
log = logging.getLogger("loom_mcp.validate")


def worker_argv(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def _job_failure(name: str, job: JobResult) -> str:
    return f"the {name} process {job.failure()}"


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
    cand_cache = code_cache(job_dir, candidate)

    # All three processes start now, so their imports and device setup overlap; each one past the
    # first waits for a signed go-file that is published only when the previous step has exited.
    token = secrets.token_hex(32)
    nonce = str(secrets.randbits(62))
    signals = job_dir / "signals"
    signals.mkdir(exist_ok=True)
    specs = {
        "prep": JobSpec(
            argv=worker_argv("loom_mcp.worker.reference"), job_dir=job_dir / "prep",
            env={**env, "LOOM_NONCE": nonce}, visible_devices=visible, timeout_s=timeout_s,
            request={"mode": "prepare", "task": str(task), "seeds": seeds, "shapes": shapes,
                     "cases_file": str(cases_file), "device": device}),
        "cand": JobSpec(
            argv=worker_argv("loom_mcp.worker.candidate"), job_dir=job_dir / "cand",
            env={**env, "LOOM_GO_SIGNER": token, "TRITON_CACHE_DIR": str(cand_cache)},
            writable=[cand_cache], visible_devices=visible, timeout_s=timeout_s,
            request={"candidate": str(candidate), "cases_file": str(cases_file),
                     "outputs_file": str(outputs_file), "device": device,
                     "go_file": str(signals / "cand.go")}),
        "comp": JobSpec(
            argv=worker_argv("loom_mcp.worker.reference"), job_dir=job_dir / "ref",
            env={**env, "LOOM_GO_SIGNER": token}, visible_devices=visible, timeout_s=timeout_s,
            request={"mode": "compare", "task": str(task), "outputs_file": str(outputs_file),
                     "device": device, "tolerances": tol_table, "plan_file": str(signals / "comp.plan"),
                     "go_file": str(signals / "comp.go")}),
    }
    jobs = StepJobs(specs, progress)

    async def steps() -> ValidationEvidence | tuple[list[dict], dict, JobResult]:
        await say("preparing inputs")
        prep = await jobs.result("prep")
        if not prep.ok or not prep.result or prep.result.get("error"):
            detail = (prep.result or {}).get("error") or _job_failure("task", prep)
            if "unknown shape" in detail:
                raise LoomError(ErrorCode.BAD_INPUT, detail.splitlines()[0].removeprefix("ValueError: "))
            raise LoomError(ErrorCode.BAD_INPUT, f"the task could not prepare inputs: {detail}")
        planned: list[dict] = prep.result["cases"]
        log.info("validation %s: prepare %.2f s (worker %.2f s)", validation_id, prep.wall_s,
                 prep.result.get("seconds") or 0.0)

        publish_go(signals / "cand.go", {}, token)
        # The reference step computes its outputs while the candidate runs (another process: the
        # candidate still runs first in its own); it compares once the candidate has exited.
        publish_go(signals / "comp.plan", {"cases": planned, "digests": prep.result["digests"]}, token)
        await say(f"running the candidate on {len(planned)} cases")
        cand = await jobs.result("cand")
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

        publish_go(signals / "comp.go", {}, token)
        await say("computing the reference and comparing")
        comp = await jobs.result("comp")
        if not comp.ok or not comp.result or comp.result.get("error"):
            detail = (comp.result or {}).get("error") or _job_failure("reference", comp)
            raise LoomError(ErrorCode.BAD_INPUT, f"the task's reference failed: {detail}")
        return planned, cand_result, comp

    outcome: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:
        jobs.start_all(tg)
        try:
            outcome["value"] = await steps()
        except LoomError as exc:  # raised after the group, so it is not wrapped in a group
            outcome["error"] = exc
        finally:
            tg.cancel_scope.cancel()  # ends any job still waiting for a go that will not come
    if "error" in outcome:
        raise outcome["error"]
    if isinstance(outcome["value"], ValidationEvidence):
        return outcome["value"]
    planned, cand_result, comp = outcome["value"]
    log.info("validation %s: compare %.2f s (worker %.2f s)", validation_id, comp.wall_s,
             comp.result.get("seconds") or 0.0)
    cases = build_cases(planned, cand_result["cases"], comp.result["cases"], findings)
    passed = bool(cases) and all(c.passed for c in cases) and not any(
        f.severity == "error" for f in findings)
    return ValidationEvidence(validation_id=validation_id, passed=passed, cases=cases, findings=findings)


class StepJobs:
    """Sandboxed jobs started together; each step's result is awaited when the step is due."""

    def __init__(self, specs: dict[str, JobSpec], progress: Progress | None) -> None:
        self.specs = specs
        self.progress = progress
        self.results: dict[str, JobResult] = {}
        self.done = {name: anyio.Event() for name in specs}

    def start_all(self, tg) -> None:
        for name in self.specs:
            tg.start_soon(self._run, name)

    async def _run(self, name: str) -> None:
        # Progress from the first job only: the others would repeat the same heartbeat.
        report = self.progress if name == next(iter(self.specs)) else None
        self.results[name] = await run_job(self.specs[name], on_progress=report)
        self.done[name].set()

    async def result(self, name: str) -> JobResult:
        await self.done[name].wait()
        return self.results[name]


def publish_go(path: Path, payload: dict, token: str) -> None:
    """Atomically write a go-file signed with the token only the waiting worker holds."""
    import hashlib
    import hmac
    import json

    body = json.dumps(payload)
    mac = hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"payload": body, "mac": mac}))
    tmp.rename(path)


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
