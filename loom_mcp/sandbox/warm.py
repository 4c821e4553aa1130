"""Warm workers: sandboxed processes that have already imported their worker module (and so
torch) and wait on stdin for the one job they will run.

Starting a worker costs seconds before it does any work: on an H200 host `import torch` alone
took 3.4-4 s, in every process of every step. Two kinds are started ahead of need and kept idle:

* **trusted** workers (task code: the reference, input preparation; `take`). Their root is cut
  before their task is known, so it holds every place a task can be (the allowed roots, the
  worktrees, the job directories), read-only.
* **blank** workers for candidate code, the benchmark's arms and its timer (`start`). Their
  root holds nothing but the system, the interpreter and a directory of their own. When the
  job comes, its init (which kept the host's tree; the worker did not) adds the job's own
  paths (`dispatch_late`, mounts._apply_late): the root the job then runs in is the one a
  fresh process would have had. Candidate code is imported only after that.

Either kind is single-use, sandboxed like any job (its job directory, environment and devices
are fixed when it starts), and takes its secrets (seed nonce, go-file key) through its stdin
pipe, which no other process can read. It exits when its stdin closes (the server exited or
discarded it) or after LOOM_WARM_IDLE_S seconds unused. Nothing of one job reaches the next.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from loom_mcp.sandbox import env as env_rules
from loom_mcp.sandbox import isolation, policy, safefs, view
from loom_mcp.sandbox.job import JobResult, JobSpec
from loom_mcp.sandbox.runner import (
    Launched,
    Progress,
    job_root,
    late_binds_possible,
    spawn,
    supervise,
)

log = logging.getLogger(__name__)

IDLE_S = 600.0
MAX_IDLE = 3  # trusted; each holds an interpreter with torch imported (hundreds of MB)
MAX_BLANK = 6  # blank: a validation's candidate, a benchmark's arms and timer
# Blank workers on a CPU: off, since their start-up would take the cores from what is timed
# (a CPU benchmark runs each block in fresh processes anyway). Tests turn it on.
BLANK_ON_CPU = False
_lock = threading.Lock()
_idle: dict[str, list[Launched]] = {}  # per key, oldest (readiest) first; keys oldest first
_late_failed: list[str] = []
_ACK_S = 30.0  # init adds a handful of mounts: milliseconds, unless the machine is swamped  # why this kernel could not add paths to a running job, once seen


def warm_argv(python: str, module: str) -> list[str]:
    return [python, "-m", "loom_mcp.worker.warm", module]


def _key(template: JobSpec, pool_dir: Path, blank: bool = False) -> str:
    """Everything fixed when a worker starts."""
    fields = template.model_dump(mode="json", exclude={"job_dir", "request", "timeout_s"})
    return json.dumps({**fields, "pool": str(pool_dir), "blank": blank}, sort_keys=True)


def _is_blank(key: str) -> bool:
    return bool(json.loads(key)["blank"])


def trusted_readable(pool_dir: Path) -> list[Path]:
    """What a trusted warm worker may read. It is started before its task is known, so its root
    cannot be cut to one task's directory: it gets the allowed roots (where every task lives),
    the server's worktrees (frozen tasks of submissions) and the job directories (the run it
    is given writes its signals and the candidate's outputs there), all read-only. LOOM_HOME
    itself stays masked (ledger, loom.toml), as do credentials under a home directory that is
    an allowed root (view.HOME_SECRETS). Candidates never run in warm workers."""
    limits = policy.current()
    paths = [*limits.trusted_roots, pool_dir.parent]
    if limits.loom_home is not None:
        worktrees = limits.loom_home / "worktrees"
        # A bind shows what is created in the directory later, but only if it existed first:
        # the worker may outlive the start of the first submission.
        with contextlib.suppress(OSError):
            worktrees.mkdir(parents=True, exist_ok=True)
        paths.append(worktrees)
    return [p for p in paths if p.exists()]


def _fresh(template: JobSpec, pool_dir: Path, blank: bool = False) -> Launched:
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
    spec = template.model_copy(
        update={
            "job_dir": pool_dir / (f"b{stamp}" if blank else f"w{stamp}"),
            "request": None,
            "env": {**template.env, "LOOM_WARM_IDLE_S": str(int(IDLE_S))},
            "readable": template.readable if blank else [*template.readable, *trusted_readable(pool_dir)],
        }
    )
    return spawn(spec, late=True) if blank else spawn(spec, stdin_pipe=True)


def _take_idle(key: str) -> Launched | None:
    """The oldest idle worker for `key` that is still alive (it has had longest to start) and
    not about to give up waiting: one given its job as its idle time runs out could exit without
    running it, which would read as the job's own failure."""
    dead: list[Launched] = []
    worker = None
    fresh_after = time.monotonic() - IDLE_S * 0.9
    with _lock:
        queue = _idle.get(key, [])
        while queue and worker is None:
            first = queue.pop(0)
            if first.alive() and first.born > fresh_after:
                worker = first
            else:
                dead.append(first)
        if not queue:
            _idle.pop(key, None)
    for old in dead:
        old.discard()
    return worker


def idle_workers() -> list[Launched]:
    with _lock:
        return [w for queue in _idle.values() for w in queue]


def prewarm(template: JobSpec, pool_dir: Path, depth: int = 1, blank: bool = False) -> None:
    """Start workers for `template` until `depth` are idle for it, to be taken later. Call it
    from a thread that outlives the workers (the event loop's; see runner.spawn).

    A depth of 2 matters where one step takes a worker and the next step comes within a
    start-up time: the benchmark refills after its timing and the next validation follows at
    once, so with one idle worker it met one still importing torch."""
    key = _key(template, pool_dir, blank)
    cap = MAX_BLANK if blank else MAX_IDLE
    depth = min(depth, cap)  # deeper could never be reached: each start would evict one
    surplus: list[Launched] = []
    while True:
        with _lock:
            queue = _idle.setdefault(key, [])
            surplus.extend(w for w in queue if not w.alive())
            queue[:] = [w for w in queue if w.alive()]
            if len(queue) >= depth:
                break
        worker = _fresh(template, pool_dir, blank)
        with _lock:
            _idle.setdefault(key, []).append(worker)
            _idle[key] = _idle.pop(key)  # newest key last: evicted last
            while sum(len(q) for k, q in _idle.items() if _is_blank(k) == blank) > cap:
                oldest = next(k for k in _idle if _is_blank(k) == blank)
                surplus.append(_idle[oldest].pop(0))
                if not _idle[oldest]:
                    del _idle[oldest]
    for old in surplus:
        old.discard()


async def take(template: JobSpec, pool_dir: Path, *, refill: bool = True, depth: int = 1) -> Launched:
    """A worker for `template`: the oldest idle one if there is one, else one started now; its
    directory is linked at `template.job_dir`. With `refill`, others are started until `depth`
    wait for the next callers (leave it off while something is being timed on the CPU: their
    start-up would compete for the cores)."""
    await anyio.to_thread.run_sync(isolation.capabilities)  # probed once, off the loop
    # Spawned on the loop's thread, never a pooled one (see runner.spawn: PDEATHSIG).
    worker = _take_idle(_key(template, pool_dir))
    if worker is None:
        worker = _fresh(template, pool_dir)
        log.debug("warm: none idle, started %s", worker.job_dir.name)
    link_into(worker, template.job_dir)
    if refill:
        prewarm(template, pool_dir, depth)
    return worker


def _blank_template(spec: JobSpec, base_env: dict[str, str]) -> JobSpec | None:
    """What a blank worker for `spec` starts with: the same worker module, limits and devices,
    `base_env` (what every job of its kind has), and none of the job's paths."""
    if len(spec.argv) != 3 or spec.argv[1] != "-m":
        return None
    return spec.model_copy(
        update={
            "argv": warm_argv(spec.argv[0], spec.argv[2]),
            "env": dict(base_env),
            "readable": [],
            "writable": [],
            "shm_dir": None,
            "request": None,
        }
    )


def blanks_for(device: str) -> bool:
    return device != "cpu" or BLANK_ON_CPU


async def start(
    spec: JobSpec, pool_dir: Path, *, base_env: dict[str, str], blank: bool = True, refill: bool = True, depth: int = 1
) -> Launched:
    """`spec` started: in an idle blank worker given the job's paths when there is one, else in
    a fresh process. `base_env` is the part of `spec.env` that every job of its kind shares (the
    rest reaches the worker with its job). With `refill`, blank workers are started until
    `depth` wait for the next callers (leave it off while something is timed: `refill_blanks`
    afterwards). Without `blank`, simply a fresh process. Supervise the result as any job."""
    await anyio.to_thread.run_sync(isolation.capabilities)  # probed once, off the loop
    template = _blank_template(spec, base_env)
    if not blank or template is None or _late_failed or not late_binds_possible(spec):
        return spawn(spec)
    worker = _take_idle(_key(template, pool_dir, blank=True))
    launched = None
    if worker is not None:
        alias = spec.job_dir.expanduser().parent.resolve() / spec.job_dir.name
        error = await anyio.to_thread.run_sync(dispatch_late, worker, spec, base_env, alias)
        if error is None:
            link_into(worker, alias)
            launched = worker
        else:
            log.info("warm: blank worker not used (%s); starting a fresh one", error)
            worker.discard()
    if launched is None:
        launched = spawn(spec)  # on the loop's thread (see runner.spawn)
    if refill:
        prewarm(template, pool_dir, depth, blank=True)
    return launched


def refill_blanks(spec: JobSpec, pool_dir: Path, *, base_env: dict[str, str], depth: int = 1) -> None:
    """Start blank workers for jobs like `spec` until `depth` are idle. On the loop's thread."""
    template = _blank_template(spec, base_env)
    if template is not None and not _late_failed and late_binds_possible(spec):
        prewarm(template, pool_dir, depth, blank=True)


def dispatch_late(worker: Launched, spec: JobSpec, base_env: dict[str, str], alias: Path) -> str | None:
    """Give a blank worker the job `spec`: its request, the paths its root lacks (sent to its
    init, which adds them and acknowledges before the worker hears anything), then its
    environment. `alias` (where `spec.job_dir` is named) is bound to the worker's own directory,
    so paths under it in the request lead there. Blocking. None when the worker has the job;
    otherwise why not (the worker is then unusable: discard it)."""
    if worker.view_ops is None or worker.ack_r is None or not worker.alive():
        return "not a live blank worker"
    if os.path.lexists(alias):
        return f"{alias} exists already"
    writable = [Path(p).resolve() for p in spec.writable]
    try:
        for path in writable:
            path.mkdir(parents=True, exist_ok=True)
        ops = view.late_entries(worker.view_ops, job_root(spec, worker.job_dir, writable))
        if alias != worker.job_dir:
            ops = view.sort_entries(
                [*ops, {"op": "bind", "path": str(alias), "src": str(worker.job_dir), "mode": "rw", "optional": False}]
            )
        if spec.request is not None:
            safefs.write_text(worker.job_dir, worker.request_path.name, json.dumps(spec.request))
    except (OSError, ValueError) as exc:
        return str(exc)
    go_env = {
        k: v
        for k, v in spec.env.items()
        if base_env.get(k) != v
        and (k in env_rules.SERVER_NAMES or not (env_rules.is_secret(k) or env_rules.is_secret_value(v)))
    }
    if "TMPDIR" in go_env:
        go_env.update(TMP=go_env["TMPDIR"], TEMP=go_env["TMPDIR"])
    message = {"ops": ops, "go": json.dumps({"env": go_env})}
    sent = time.monotonic()
    try:
        assert worker.process.stdin is not None
        worker.process.stdin.write((json.dumps(message) + "\n").encode())
        worker.process.stdin.close()
        ready = select.select([worker.ack_r], [], [], _ACK_S)[0]
        reply = os.read(worker.ack_r, 1 << 16) if ready else b""
    except (OSError, ValueError) as exc:
        return f"cannot reach its init: {exc}"
    finally:
        os.close(worker.ack_r)
        worker.ack_r = None
    try:
        ack = json.loads(reply)
    except ValueError:
        ack = None
    if not isinstance(ack, dict):  # it died meanwhile (or never answered): this worker only
        return "no answer from its init" if not reply else reply[:200].decode(errors="replace")
    if not ack.get("ok"):
        error = str(ack.get("error"))
        if not _late_failed:  # init itself refused: so will every other
            log.warning(
                "sandbox: this kernel cannot add a job's paths to a running worker (%s); "
                "every job gets a fresh process",
                error,
            )
            _late_failed.append(error)
        return error
    for problem in ack.get("problems") or []:
        log.debug("sandbox: optional entry not added: %s", problem)
    log.info(
        "warm: %s runs in blank worker %s (%d paths added in %.1f ms)",
        spec.job_dir.name,
        worker.job_dir.name,
        len(ops),
        1000 * (time.monotonic() - sent),
    )
    worker.spec = spec
    worker.watched = (worker.job_dir, *writable)
    return None


def link_into(worker: Launched, link: Path) -> None:
    """Make `link` (in the calling run's job directory) point at the worker's own directory, so
    a run's directory still shows every step it ran."""
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(worker.job_dir, target_is_directory=True)
    except OSError:
        log.debug("warm: could not link %s to %s", link, worker.job_dir)


async def run_warm(
    worker: Launched,
    request: dict[str, Any],
    *,
    secret_env: dict[str, str],
    timeout_s: float,
    on_progress: Progress | None = None,
) -> JobResult:
    """Give a taken worker its job (request written to its directory, secrets over stdin) and
    supervise it to the end; the timeout counts from now."""
    # The worker has been running in this directory: replace the name, never write through it.
    safefs.write_text(worker.job_dir, worker.request_path.name, json.dumps(request))
    worker.spec = worker.spec.model_copy(update={"timeout_s": timeout_s, "request": request})
    line = (json.dumps({"env": secret_env}) + "\n").encode()
    try:
        assert worker.process.stdin is not None
        worker.process.stdin.write(line)
        worker.process.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # it died while idle; supervising reports how
    return await supervise(worker, on_progress)


def discard_all() -> None:
    """End every idle worker (tests; a server shutting down closes their stdin anyway)."""
    with _lock:  # one hold: a worker taken or added meanwhile is neither killed nor leaked
        workers = [w for queue in _idle.values() for w in queue]
        _idle.clear()
    for worker in workers:
        worker.discard()
