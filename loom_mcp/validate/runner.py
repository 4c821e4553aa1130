"""run_validation: two sandboxed processes, then a verdict on correctness built in the server.

1. `reference` (trusted task code, a warm worker when one is idle): plans shape x seed x
   input-kind cases from a secret nonce, writes the first case's inputs and signals the
   candidate to start, then the rest one at a time (a finished case's files are deleted);
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

import json
import logging
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import anyio

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import DEFAULT_TOLERANCES, Finding, ValidationCase, ValidationEvidence
from loom_mcp.placement import job_placement
from loom_mcp.sandbox import (
    JobResult,
    JobSpec,
    code_cache,
    code_cache_env,
    policy,
    safefs,
    warm,
)
from loom_mcp.sandbox.job import MODEL_JOB_ENV, REFERENCE_JOB_ENV
from loom_mcp.sandbox.runner import Progress, supervise
from loom_mcp.sandbox.sources import code_files
from loom_mcp.validate.static_checks import check_candidate_source
from loom_mcp.worker.guard import findings as guard_findings
from loom_mcp.worker.protocol import publish_go

log = logging.getLogger("loom_mcp.validate")


def worker_argv(module: str) -> list[str]:
    return [sys.executable, "-m", module]


# The per-file limit of validation's jobs. Tensors travel in files of at most this size
# (loom_mcp.worker.handoff splits larger ones), so it bounds no problem's size.
JOB_FILE_BYTES = JobSpec.model_fields["max_file_bytes"].default
# Inputs on disk at once, past two cases (loom_mcp.worker.fits).
INPUT_WINDOW_BYTES = 4 << 30
TRUSTED_DEPTH = warm.MAX_IDLE  # idle trusted workers kept on a GPU host
SMALLER_PROBLEM = (
    "Validate a smaller problem: fewer shapes (shapes=[...]) or smaller sizes through "
    'task_globals (e.g. task_globals={"batch_size": 16}).'
)
MORE_MEMORY = " Or raise job_memory_bytes in loom.toml where the machine has the memory."
_GPU_FULL = re.compile(r"OutOfMemoryError: CUDA out of memory|HIP out of memory|hipErrorOutOfMemory")


def out_of_memory(job: JobResult) -> bool:
    """The job ended for lack of memory: its own limit (memory_exceeded), or SIGKILL that we
    did not send (no timeout, no cancel, no disk quota): the kernel's OOM killer."""
    return job.memory_exceeded or (
        job.signal == "SIGKILL" and not job.timed_out and not job.cancelled and not job.disk_exceeded
    )


def _job_failure(name: str, job: JobResult) -> str:
    return f"the {name} process {job.failure()}"


def static_findings(candidate: Path) -> list[Finding]:
    """The static checks over the candidate and every source it declares: Python is its code
    too, and native sources (.cu, .h, ...) are scanned as inline native source is. A declared
    Python source may read what the candidate declares below its own directory. The candidate
    has a kernel when any of its Python files has one."""
    files = code_files(candidate)
    per_file: list[tuple[Path, list[Finding]]] = []
    for path in files:
        readable = None
        if path != candidate:
            readable = [
                p.relative_to(path.parent).as_posix() for p in files if p != path and p.is_relative_to(path.parent)
            ]
        found = check_candidate_source(safefs.read_resolved_text(path), str(path), declared_sources=readable)
        per_file.append((path, found))
    has_kernel = any(
        path.suffix == ".py" and not any(f.check == "static.no_kernel" for f in found) for path, found in per_file
    )
    return [f for _, found in per_file for f in found if not (has_kernel and f.check == "static.no_kernel")]


class _LendFailed(Exception):
    """The candidate's process could not open device memory the reference lent it. `findings`:
    the errors found before that (its guard's), which the run through files keeps."""

    def __init__(self, message: str, findings: list[Finding]) -> None:
        super().__init__(message)
        self.findings = findings


def _lent_a_case(cases_dir: Path) -> bool:
    """Whether the reference lent any case in device memory (its manifests, in its own
    directory, name a region): only then can the candidate fail to open one."""
    try:
        return any('"lent"' in m.read_text(errors="replace") for m in cases_dir.glob("c*/manifest.json"))
    except OSError:
        return False


async def validate_candidate(**kwargs: Any) -> ValidationEvidence:
    """Validate `candidate` against `task` (see _validate). Where the candidate's process cannot
    open the device memory a big case is lent in (loom_mcp.worker.lending), the validation runs
    again with every case in files: a limit of this machine is never the candidate's failure."""
    try:
        return await _validate(**kwargs, lend_on_device=True)
    except _LendFailed as exc:
        log.warning(
            "validation %s: lending device memory failed (%s); again through files", kwargs.get("validation_id"), exc
        )
        job_dir = Path(kwargs["job_dir"])  # a sibling: the compile cache is found from the depth
        again = await _validate(
            **{**kwargs, "job_dir": job_dir.with_name(job_dir.name + "-files")}, lend_on_device=False
        )
        if exc.findings:
            again = again.model_copy(update={"passed": False, "findings": [*exc.findings, *again.findings]})
        return again


async def _validate(
    *,
    lend_on_device: bool,
    task: Path,
    candidate: Path,
    job_dir: Path,
    seeds: int,
    shapes: list[str] | None,
    device: str,
    timeout_s: float,
    tolerances: dict[str, Any] | None = None,
    task_globals: dict[str, Any] | None = None,
    validation_id: str,
    keep_warm: bool = True,
    progress: Progress | None = None,
) -> ValidationEvidence:
    async def say(message: str) -> None:
        if progress:
            await progress(message)

    findings = static_findings(candidate)
    job_dir.mkdir(parents=True, exist_ok=True)
    device, env, visible = job_placement(device)
    tol_table = {k: v.model_dump() for k, v in DEFAULT_TOLERANCES.items()}
    tol_table.update(tolerances or {})
    outputs_dir = job_dir / "cand" / "outputs"
    taken_dir = job_dir / "taken"
    taken_dir.mkdir(parents=True, exist_ok=True)
    cand_cache = code_cache(job_dir, candidate)

    began = time.time()
    token = secrets.token_hex(32)
    signals = job_dir / "signals"
    signals.mkdir(exist_ok=True)
    reference = await warm.take(
        JobSpec(
            argv=warm.warm_argv(sys.executable, "loom_mcp.worker.reference"),
            job_dir=job_dir / "ref",
            env={**env, **REFERENCE_JOB_ENV},
            visible_devices=visible,
            timeout_s=timeout_s,
            max_file_bytes=JOB_FILE_BYTES,
        ),
        # Three kept on a GPU host, shared with the benchmark's input preparation: each step
        # takes the oldest, so neither meets one started a step ago (with candidates in blank
        # workers a step is ~5 s, less than a start-up with its warm-up). On a CPU each
        # start-up takes a core from this job.
        job_dir.parent / "warm",
        refill=keep_warm,
        depth=1 if device == "cpu" else TRUSTED_DEPTH,
    )
    # Written by the reference worker, so in its own directory (the only one it may write).
    cases_dir, cand_go = reference.job_dir / "cases", reference.job_dir / "cand.go"
    cand_spec = JobSpec(
        argv=worker_argv("loom_mcp.worker.candidate"),
        job_dir=job_dir / "cand",
        env={**env, "LOOM_GO_SIGNER": token, **code_cache_env(cand_cache), **MODEL_JOB_ENV},
        # its root holds its own directory (the candidate imports siblings) and the inputs
        readable=[*code_files(candidate), reference.job_dir],
        writable=[cand_cache],
        visible_devices=visible,
        timeout_s=timeout_s,
        max_file_bytes=JOB_FILE_BYTES,
        request={
            "candidate": str(candidate),
            "cases_dir": str(cases_dir),
            "outputs_dir": str(outputs_dir),
            "device": device,
            "go_file": str(cand_go),
            "task_globals": task_globals or {},
        },
    )
    # The limits the reference sizes the job against before it makes any input.
    cand_memory = policy.current().memory_bytes if cand_spec.max_memory_bytes is None else cand_spec.max_memory_bytes
    ref_request = {
        "mode": "validate",
        "task": str(task),
        "seeds": seeds,
        "shapes": shapes,
        "cases_dir": str(cases_dir),
        "device": device,
        "tolerances": tol_table,
        "outputs_dir": str(taken_dir),  # what the candidate published, moved out of its reach
        "cand_go_file": str(cand_go),
        "go_file": str(signals / "ref.go"),
        "task_globals": task_globals or {},
        "memory_limit_bytes": reference.memory_bytes,
        "candidate_memory_limit_bytes": cand_memory,
        "disk_limit_bytes": policy.current().disk_bytes,
        "input_window_bytes": INPUT_WINDOW_BYTES,
        "lend_on_device": lend_on_device,
    }
    cand_dir = [job_dir / "cand"]  # the candidate's own directory, once it has one
    taker = OutputTaker(cand_dir, cases_dir / "cases.json", taken_dir)

    async def run_candidate() -> JobResult:
        # A blank worker (torch imported, no path of this job in its root until now) where one
        # is idle: the candidate's start-up is off the critical path.
        launched = await warm.start(
            cand_spec,
            job_dir.parent / "warm",
            base_env={**env, **MODEL_JOB_ENV},
            blank=keep_warm and warm.blanks_for(device),
            refill=keep_warm,
        )
        cand_dir[0] = launched.job_dir
        return await supervise(launched)

    jobs = StepJobs(
        {
            # Progress from the reference: it runs from the first moment to the last.
            "ref": lambda: warm.run_warm(
                reference,
                ref_request,
                timeout_s=timeout_s,
                on_progress=progress,
                secret_env={"LOOM_NONCE": str(secrets.randbits(62)), "LOOM_GO_SIGNER": token},
            ),
            "cand": run_candidate,
        }
    )

    def reference_failure(ref: JobResult) -> LoomError:
        # The reference worker runs no candidate code: what it sends is an object (or nothing).
        sent = cast("dict[str, Any]", ref.result or {})
        detail = sent.get("error") or _job_failure("reference", ref)
        if sent.get("error_code") == "RESOURCE_LIMIT":
            return LoomError(ErrorCode.RESOURCE_LIMIT, f"validation does not fit: {detail}")
        if out_of_memory(ref):
            return LoomError(
                ErrorCode.RESOURCE_LIMIT,
                "the reference process ran out of memory "
                f"({_job_failure('reference', ref)}). {SMALLER_PROBLEM}{MORE_MEMORY}",
            )
        if ref.timed_out:
            return LoomError(
                ErrorCode.TIMEOUT,
                f"the reference process timed out after "
                f"{ref.wall_s:.0f} s (job_timeout_s) computing and comparing every case "
                f"in float64. {SMALLER_PROBLEM} Or raise job_timeout_s in loom.toml.",
            )
        if ref.disk_exceeded:
            return LoomError(
                ErrorCode.RESOURCE_LIMIT,
                f"the reference process {ref.limit_exceeded} writing the inputs. {SMALLER_PROBLEM}",
            )
        if "unknown shape" in detail:
            return LoomError(ErrorCode.BAD_INPUT, detail.splitlines()[0].removeprefix("ValueError: "))
        return LoomError(ErrorCode.BAD_INPUT, f"the task's reference failed: {detail}")

    async def steps() -> ValidationEvidence | tuple[JobResult, dict]:
        await say("preparing inputs; the candidate runs once they are written")
        # The reference cannot finish before the candidate has: ending first means it failed.
        if await jobs.first_done("ref", "cand") == "ref":
            raise reference_failure(jobs.results["ref"])
        cand = jobs.results["cand"]
        cand_result = cand.report  # None unless a JSON object: the candidate could send anything
        # What the candidate worker's audit hook refused: from its result and from the lines it
        # wrote to stderr as each happened (either channel is enough; errors fail validation).
        reported = cand.result.get("guard") if isinstance(cand.result, dict) else None
        findings.extend(
            Finding(**f) for f in guard_findings(reported if isinstance(reported, list) else None, cand.stderr_tail)
        )
        log.info("validation %s: candidate exited after %.2f s (%s)", validation_id, cand.wall_s, cand.timeline(began))
        if cand_result is not None and cand_result.get("lend_error"):
            if lend_on_device and _lent_a_case(cases_dir):
                raise _LendFailed(str(cand_result["lend_error"])[:300], [f for f in findings if f.severity == "error"])
            findings.append(
                Finding(
                    check="validation.crash",
                    severity="error",
                    message="the candidate reported a device-memory hand-over that was never offered",
                )
            )
            return ValidationEvidence(validation_id=validation_id, passed=False, cases=[], findings=findings)
        if cand_result is None and out_of_memory(cand) and not cand.memory_exceeded:
            # Killed by the kernel for the machine's memory, not for its own limit: the problem
            # is too big for this machine, whichever process the kernel picked.
            raise LoomError(
                ErrorCode.RESOURCE_LIMIT,
                "the candidate process was killed with "
                "SIGKILL while it ran: the machine ran out of memory (the kernel's OOM "
                f"killer). {SMALLER_PROBLEM}{MORE_MEMORY}",
            )
        if cand_result is None:
            findings.append(
                Finding(check="validation.crash", severity="error", message=_job_failure("candidate", cand))
            )
        elif cand_result.get("load_error"):
            findings.append(
                Finding(
                    check="validation.import",
                    severity="error",
                    message="the candidate failed to import: " + cand_result["load_error"],
                )
            )
        if (
            cand_result is None
            or cand_result.get("load_error")
            or not safefs.is_file(cand_dir[0], "outputs/cases.json")
        ):
            runs = cand_result.get("cases") if cand_result else None
            for run in runs if isinstance(runs, list) else []:
                if isinstance(run, dict) and run.get("error"):  # why the harness stopped
                    findings.append(
                        Finding(check="validation.outputs", severity="error", message=str(run["error"])[:500])
                    )
            return ValidationEvidence(validation_id=validation_id, passed=False, cases=[], findings=findings)

        taker.finish()
        publish_go(str(signals / "ref.go"), {}, token)
        await say("comparing with the reference")
        ref = await jobs.result("ref")
        if not ref.ok or not ref.result or cast("dict[str, Any]", ref.result).get("error"):
            raise reference_failure(ref)
        return ref, cand_result

    outcome: dict[str, Any] = {}
    try:
        async with anyio.create_task_group() as tg:
            jobs.start_all(tg)
            tg.start_soon(taker.run)
            try:
                outcome["value"] = await steps()
            except (LoomError, _LendFailed) as exc:  # raised after the group, so not wrapped in one
                outcome["error"] = exc
            finally:
                tg.cancel_scope.cancel()  # ends any job still waiting for a go that will not come
    finally:
        # The inputs and outputs are scratch (the evidence is in the ledger), and big: hundreds
        # of MB per validation that would otherwise pile up over a campaign.
        # Unlinked by name beneath their directories: no link on the way is followed.
        safefs.discard(reference.job_dir, cases_dir.name)
        safefs.discard(cand_dir[0], "outputs")
        if reference.alive() and "ref" not in jobs.results:
            reference.discard()
    if "error" in outcome:
        raise outcome["error"]
    if isinstance(outcome["value"], ValidationEvidence):
        return outcome["value"]
    ref, cand_result = outcome["value"]
    log.info(
        "validation %s: reference done %.2f s after it was given the job (%s)",
        validation_id,
        ref.wall_s,
        ref.timeline(began),
    )
    lent = ref.result.get("lent_cases")
    if lent:
        log.info(
            "validation %s: %s of %d case(s) lent in device memory", validation_id, lent, len(ref.result["planned"])
        )
    cases = build_cases(ref.result["planned"], cand_result["cases"], ref.result["cases"], findings)
    errors = [str(run.get("error") or "") for run in cand_result["cases"] if isinstance(run, dict)]
    if errors and all(_GPU_FULL.search(e) for e in errors if e) and any(errors):
        # The candidate shares the GPU with the reference's process: a problem this big does not
        # tell us anything about the candidate, and an honest copy of the reference fails alike.
        first = next(e for e in errors if e).splitlines()[0]
        held = _memory_note(cand_result["cases"])
        raise LoomError(
            ErrorCode.RESOURCE_LIMIT,
            "the GPU ran out of memory while the candidate "
            f"ran its cases beside the reference ({first[:300]}){held}. {SMALLER_PROBLEM}",
        )
    passed = bool(cases) and all(c.passed for c in cases) and not any(f.severity == "error" for f in findings)
    return ValidationEvidence(validation_id=validation_id, passed=passed, cases=cases, findings=findings)


def _memory_note(runs: list) -> str:
    """What the candidate's process held on the device per case (its own advisory report)."""
    parts = []
    for i, run in enumerate(runs):
        if isinstance(run, dict) and isinstance(run.get("held_bytes"), int) and isinstance(run.get("peak_bytes"), int):
            parts.append(
                f"case {i}: {run['held_bytes'] / 2**30:.1f} GiB held before, peak {run['peak_bytes'] / 2**30:.1f}"
            )
    return f"; the candidate's process reported {', '.join(parts[:6])} GiB" if parts else ""


class OutputTaker:
    """Moves each case's outputs out of the candidate's directory as soon as it publishes them,
    into one only the reference reads: the candidate's process could otherwise rewrite an
    earlier case's files while a later case runs, or at exit. The candidate's harness waits
    for each move before it runs candidate code again (loom_mcp.worker.candidate). No link in
    the candidate's directory is followed, and what arrives must be a plain directory."""

    POLL_S = 0.003

    def __init__(self, cand_dir: list[Path], count_file: Path, taken: Path) -> None:
        self.cand_dir, self.count_file, self.taken = cand_dir, count_file, taken
        self.moved = 0
        self.count: int | None = None

    def _planned(self) -> int | None:
        if self.count is None and self.count_file.is_file():  # written by the trusted reference
            try:
                self.count = int(json.loads(self.count_file.read_text())["cases"])
            except (OSError, ValueError, KeyError, TypeError):
                return None
        return self.count

    def sweep(self) -> None:
        count = self._planned()
        while count is not None and self.moved < count:
            name = f"c{self.moved}"
            base = self.cand_dir[0]
            if not safefs.is_file(base, f"outputs/{name}/manifest.json"):
                return
            try:
                src = safefs.open_dir(base, "outputs")
            except (OSError, safefs.UnsafeFileError):
                return
            dst = os.open(self.taken, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=src, follow_symlinks=False).st_mode):
                    os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
                    if not stat.S_ISDIR(os.stat(name, dir_fd=dst, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=dst)  # swapped for a link meanwhile: not outputs
            except OSError as exc:
                log.info("outputs of case %d not taken: %s", self.moved, exc)
            finally:
                os.close(src)
                os.close(dst)
            self.moved += 1

    async def run(self) -> None:
        while True:
            self.sweep()
            await anyio.sleep(self.POLL_S)

    def finish(self) -> None:
        """After the candidate exited: take what is left, and say how many cases there are."""
        self.sweep()
        (self.taken / "cases.json").write_text(json.dumps({"cases": self.moved}))


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


def _threads_message(run: dict) -> str:
    """Which threads the candidate left running, started where, and why that fails validation.
    Threads that torch.compile and other libraries start are not counted (see
    harness.track_threads)."""
    described = []
    for t in (run.get("threads") or [])[:3]:
        if not isinstance(t, dict):
            continue
        text = f"'{str(t.get('name'))[:60]}' started at {str(t.get('started_at'))[:120]}"
        if t.get("running"):
            text += f", running {str(t.get('running'))[:120]}"
        described.append(text)
    which = "; ".join(described) or f"{run['threads_added']} thread(s)"
    return (
        f"forward left a thread of the candidate's running after it returned ({which}). Work "
        "still running can change outputs after they are checked and races with the next "
        "call: finish or join it before returning (threads that torch.compile and other "
        "libraries start are not counted)"
    )


def build_cases(
    planned: list[dict], ran: list[dict], compared: list[dict], findings: list[Finding]
) -> list[ValidationCase]:
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
            once("validation.aliasing", f"{label}: an output shares storage with an input; return a new tensor")
        if not run["inputs_unchanged"]:
            problems.append("inputs were modified")
            once("validation.input_mutation", f"{label}: forward modified its inputs in place")
        if not run["deterministic"]:
            problems.append("rerun not bitwise identical")
            once(
                "validation.determinism",
                f"{label}: a second run on the same inputs gave different "
                "bits (uninitialised memory, a race, or atomics)",
            )
        if run["late_write"]:
            problems.append("outputs changed after return")
            once(
                "validation.late_write",
                f"{label}: outputs changed after forward returned (work on another stream or thread)",
            )
        if run["threads_added"] > 0:
            problems.append("left threads running")
            once("validation.threads", f"{label}: {_threads_message(run)}")
        if not comp["inputs_reproducible"]:
            once(
                "task.nondeterministic_inputs",
                f"{label}: the task's get_inputs is not reproducible "
                "from the seed; fix the task (use torch's global RNG)",
            )
            problems.append("task inputs not reproducible")
        if comp.get("error"):
            problems.append(comp["error"].splitlines()[0])
            once("validation.outputs", f"{label}: {comp['error']}")
        if comp.get("degenerate") and "validation.degenerate" not in seen:
            seen.add("validation.degenerate")
            findings.append(
                Finding(
                    check="validation.degenerate",
                    severity="warning",
                    message=f"{label}: the reference output is (nearly) constant; a "
                    "constant could pass. Strengthen the task's inputs",
                )
            )
        outputs = comp.get("outputs") or []
        if not outputs:
            cases.append(
                ValidationCase(
                    shape=plan["shape"]["name"],
                    seed=plan["seed"],
                    input_kind=plan["kind"],
                    atol=0,
                    rtol=0,
                    passed=False,
                    output_type_ok=run["output_type_ok"],
                    inputs_unchanged=run["inputs_unchanged"],
                    deterministic=run["deterministic"],
                    message="; ".join(problems) or "no output to compare",
                )
            )
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
            cases.append(
                ValidationCase(
                    shape=plan["shape"]["name"],
                    seed=plan["seed"],
                    input_kind=plan["kind"],
                    dtype=out["dtype"],
                    max_abs_err=out["max_abs_err"],
                    max_rel_err=out["max_rel_err"],
                    mismatched=out["mismatched"],
                    atol=out["atol"],
                    rtol=out["rtol"],
                    passed=ok,
                    atol_effective=out.get("atol_effective"),
                    norm_rel_err=out.get("norm_rel_err"),
                    norm_rel_bound=out.get("norm_rel_bound"),
                    ref_norm_rel_err=out.get("ref_norm_rel_err"),
                    ref_max_abs_err=out.get("ref_max_abs_err"),
                    ref_rms=out.get("ref_rms"),
                    shape_match=out["shape_match"],
                    nan_inf_parity=out["nan_inf_parity"],
                    output_type_ok=run["output_type_ok"] and not run["aliases_input"],
                    inputs_unchanged=run["inputs_unchanged"],
                    deterministic=run["deterministic"],
                    message="; ".join(filter(None, [out["message"], *problems])) or None,
                )
            )
    return cases
