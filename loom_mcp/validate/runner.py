"""run_validation: two sandboxed processes, then a verdict on correctness built in the server.

1. `reference` (trusted task code, a warm worker when one is idle): plans shape x seed x
   input-kind cases from a secret nonce, writes the inputs and signals the candidate to start;
   then computes the reference (native and float64) while the candidate runs, and compares once
   the server signals that the candidate's process has exited.
2. `candidate` (untrusted): a fresh process, started at once so its imports overlap the inputs
   step, that never imports the task; runs each case twice and saves its outputs.
Go-files are signed with a token only the two workers and the server hold (in their
environment). The seed nonce travels the same way: files under the server's home are readable
by a candidate running as the same user, a process's environment is not.
The static checks read the candidate's source without running it.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import DEFAULT_TOLERANCES, Finding, ValidationCase, ValidationEvidence
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import JobResult, JobSpec, code_cache, code_cache_env, run_job, safefs, warm
from loom_mcp.validate.static_checks import check_candidate_source
from loom_mcp.worker.guard import findings as guard_findings
from loom_mcp.worker.protocol import publish_go

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
    keep_warm: bool = True,
    progress: Progress | None = None,
) -> ValidationEvidence:
    async def say(message: str) -> None:
        if progress:
            await progress(message)

    findings: list[Finding] = list(check_candidate_source(safefs.read_resolved_text(candidate),
                                                          str(candidate)))
    job_dir.mkdir(parents=True, exist_ok=True)
    device, env, visible = job_placement(device)
    tol_table = {k: v.model_dump() for k, v in DEFAULT_TOLERANCES.items()}
    tol_table.update(tolerances or {})
    outputs_file = job_dir / "cand" / "outputs.pt"
    cand_cache = code_cache(job_dir, candidate)

    began = time.time()
    token = secrets.token_hex(32)
    signals = job_dir / "signals"
    signals.mkdir(exist_ok=True)
    reference = await warm.take(
        JobSpec(argv=warm.warm_argv(sys.executable, "loom_mcp.worker.reference"), job_dir=job_dir / "ref",
                env=env, visible_devices=visible, timeout_s=timeout_s),
        job_dir.parent / "warm", refill=keep_warm)
    # Written by the reference worker, so in its own directory (the only one it may write).
    cases_file, cand_go = reference.job_dir / "cases.pt", reference.job_dir / "cand.go"
    ref_request = {"mode": "validate", "task": str(task), "seeds": seeds, "shapes": shapes,
                   "cases_file": str(cases_file), "device": device, "tolerances": tol_table,
                   "outputs_file": str(outputs_file), "cand_go_file": str(cand_go),
                   "go_file": str(signals / "ref.go")}
    cand_spec = JobSpec(
        argv=worker_argv("loom_mcp.worker.candidate"), job_dir=job_dir / "cand",
        env={**env, "LOOM_GO_SIGNER": token, **code_cache_env(cand_cache)},
        # its root holds its own directory (the candidate imports siblings) and the inputs
        readable=[candidate.parent, reference.job_dir],
        writable=[cand_cache], visible_devices=visible, timeout_s=timeout_s,
        request={"candidate": str(candidate), "cases_file": str(cases_file),
                 "outputs_file": str(outputs_file), "device": device,
                 "go_file": str(cand_go)})
    jobs = StepJobs({
        # Progress from the reference: it runs from the first moment to the last.
        "ref": lambda: warm.run_warm(reference, ref_request, timeout_s=timeout_s, on_progress=progress,
                                     secret_env={"LOOM_NONCE": str(secrets.randbits(62)),
                                                 "LOOM_GO_SIGNER": token}),
        "cand": lambda: run_job(cand_spec),
    })

    def reference_failure(ref: JobResult) -> LoomError:
        detail = (ref.result or {}).get("error") or _job_failure("reference", ref)
        if "unknown shape" in detail:
            return LoomError(ErrorCode.BAD_INPUT, detail.splitlines()[0].removeprefix("ValueError: "))
        return LoomError(ErrorCode.BAD_INPUT, f"the task's reference failed: {detail}")

    async def steps() -> ValidationEvidence | tuple[JobResult, dict]:
        await say("preparing inputs; the candidate runs once they are written")
        # The reference cannot finish before the candidate has: ending first means it failed.
        if await jobs.first_done("ref", "cand") == "ref":
            raise reference_failure(jobs.results["ref"])
        cand = jobs.results["cand"]
        cand_result = cand.result if cand.ok and cand.result else None
        # What the candidate worker's audit hook refused: from its result and from the lines it
        # wrote to stderr as each happened (either channel is enough; errors fail validation).
        reported = cand.result.get("guard") if isinstance(cand.result, dict) else None
        findings.extend(Finding(**f) for f in guard_findings(
            reported if isinstance(reported, list) else None, cand.stderr_tail))
        log.info("validation %s: candidate exited after %.2f s (%s)", validation_id, cand.wall_s,
                 cand.timeline(began))
        if cand_result is None:
            findings.append(Finding(check="validation.crash", severity="error",
                                    message=_job_failure("candidate", cand)))
        elif cand_result.get("load_error"):
            findings.append(Finding(check="validation.import", severity="error",
                                    message="the candidate failed to import: " + cand_result["load_error"]))
        if (cand_result is None or cand_result.get("load_error")
                or not safefs.is_file(job_dir, "cand/outputs.pt")):
            return ValidationEvidence(validation_id=validation_id, passed=False, cases=[], findings=findings)

        publish_go(str(signals / "ref.go"), {}, token)
        await say("comparing with the reference")
        ref = await jobs.result("ref")
        if not ref.ok or not ref.result or ref.result.get("error"):
            raise reference_failure(ref)
        return ref, cand_result

    outcome: dict[str, Any] = {}
    try:
        async with anyio.create_task_group() as tg:
            jobs.start_all(tg)
            try:
                outcome["value"] = await steps()
            except LoomError as exc:  # raised after the group, so it is not wrapped in a group
                outcome["error"] = exc
            finally:
                tg.cancel_scope.cancel()  # ends any job still waiting for a go that will not come
    finally:
        # The inputs and outputs are scratch (the evidence is in the ledger), and big: hundreds
        # of MB per validation that would otherwise pile up over a campaign.
        # Unlinked by name beneath their directories: no link on the way is followed.
        safefs.discard(reference.job_dir, cases_file.name)
        safefs.discard(job_dir, "cand/outputs.pt")
        if reference.alive() and "ref" not in jobs.results:
            reference.discard()
    if "error" in outcome:
        raise outcome["error"]
    if isinstance(outcome["value"], ValidationEvidence):
        return outcome["value"]
    ref, cand_result = outcome["value"]
    log.info("validation %s: reference done %.2f s after it was given the job (%s)", validation_id,
             ref.wall_s, ref.timeline(began))
    cases = build_cases(ref.result["planned"], cand_result["cases"], ref.result["cases"], findings)
    passed = bool(cases) and all(c.passed for c in cases) and not any(
        f.severity == "error" for f in findings)
    return ValidationEvidence(validation_id=validation_id, passed=passed, cases=cases, findings=findings)


class StepJobs:
    """Sandboxed jobs started together; each step's result is awaited when the step is due."""

    def __init__(self, starters: dict[str, Callable[[], Awaitable[JobResult]]]) -> None:
        self.starters = starters
        self.results: dict[str, JobResult] = {}
        self.done = {name: anyio.Event() for name in starters}
        self.any_done = anyio.Event()

    def start_all(self, tg) -> None:
        for name in self.starters:
            tg.start_soon(self._run, name)

    async def _run(self, name: str) -> None:
        self.results[name] = await self.starters[name]()
        self.done[name].set()
        self.any_done.set()

    async def result(self, name: str) -> JobResult:
        await self.done[name].wait()
        return self.results[name]

    async def first_done(self, *names: str) -> str:
        while True:
            finished = [n for n in names if self.done[n].is_set()]
            if finished:
                return finished[0]
            await self.any_done.wait()
            self.any_done = anyio.Event()


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
                atol_effective=out.get("atol_effective"), norm_rel_err=out.get("norm_rel_err"),
                norm_rel_bound=out.get("norm_rel_bound"), ref_norm_rel_err=out.get("ref_norm_rel_err"),
                ref_rms=out.get("ref_rms"),
                shape_match=out["shape_match"], nan_inf_parity=out["nan_inf_parity"],
                output_type_ok=run["output_type_ok"] and not run["aliases_input"],
                inputs_unchanged=run["inputs_unchanged"], deterministic=run["deterministic"],
                message="; ".join(filter(None, [out["message"], *problems])) or None))
    return cases
