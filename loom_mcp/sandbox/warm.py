"""Warm trusted workers: sandboxed processes that have already imported their worker module
(and so torch) and wait on stdin for the one job they will run.

Starting a worker costs seconds before it does any work: on an H200 host `import torch` alone
took 3.4 s. The trusted steps sit on the critical path (validation's input preparation, the
benchmark's input sets), so a worker for them is started ahead of need and kept idle. Only
trusted workers (task code: the reference, input preparation) are kept warm; a candidate
always gets a fresh process started for it, so nothing of one job can reach the next.

A warm worker is single-use, sandboxed like any job (its job directory, environment and
devices are fixed when it starts), and takes its secrets (seed nonce, go-file key) through its
stdin pipe, which no other process can read. It exits when its stdin closes (the server exited
or discarded it) or after LOOM_WARM_IDLE_S seconds unused.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from loom_mcp.sandbox import isolation, policy, safefs
from loom_mcp.sandbox.job import JobResult, JobSpec
from loom_mcp.sandbox.runner import Launched, Progress, spawn, supervise

log = logging.getLogger(__name__)

IDLE_S = 600.0
MAX_IDLE = 3  # each holds an interpreter with torch imported (hundreds of MB)
_lock = threading.Lock()
_idle: dict[str, list[Launched]] = {}  # per key, oldest (readiest) first; keys oldest first


def warm_argv(python: str, module: str) -> list[str]:
    return [python, "-m", "loom_mcp.worker.warm", module]


def _key(template: JobSpec, pool_dir: Path) -> str:
    """Everything fixed when a worker starts."""
    fields = template.model_dump(mode="json", exclude={"job_dir", "request", "timeout_s"})
    return json.dumps({**fields, "pool": str(pool_dir)}, sort_keys=True)


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


def _fresh(template: JobSpec, pool_dir: Path) -> Launched:
    spec = template.model_copy(update={
        "job_dir": pool_dir / f"w{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}",
        "request": None,
        "env": {**template.env, "LOOM_WARM_IDLE_S": str(int(IDLE_S))},
        "readable": [*template.readable, *trusted_readable(pool_dir)],
    })
    return spawn(spec, stdin_pipe=True)


def _take_idle(key: str) -> Launched | None:
    """The oldest idle worker for `key` that is still alive (it has had longest to start)."""
    dead: list[Launched] = []
    worker = None
    with _lock:
        queue = _idle.get(key, [])
        while queue and worker is None:
            first = queue.pop(0)
            if first.alive():
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


def prewarm(template: JobSpec, pool_dir: Path, depth: int = 1) -> None:
    """Start workers for `template` until `depth` are idle for it, to be taken later. Call it
    from a thread that outlives the workers (the event loop's; see runner.spawn).

    A depth of 2 matters where one step takes a worker and the next step comes within a
    start-up time: the benchmark refills after its timing and the next validation follows at
    once, so with one idle worker it met one still importing torch."""
    key = _key(template, pool_dir)
    depth = min(depth, MAX_IDLE)  # deeper could never be reached: each start would evict one
    surplus: list[Launched] = []
    while True:
        with _lock:
            queue = _idle.setdefault(key, [])
            surplus.extend(w for w in queue if not w.alive())
            queue[:] = [w for w in queue if w.alive()]
            if len(queue) >= depth:
                break
        worker = _fresh(template, pool_dir)
        with _lock:
            _idle.setdefault(key, []).append(worker)
            _idle[key] = _idle.pop(key)  # newest key last: evicted last
            while sum(len(q) for q in _idle.values()) > MAX_IDLE:
                oldest = next(iter(_idle))
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


def link_into(worker: Launched, link: Path) -> None:
    """Make `link` (in the calling run's job directory) point at the worker's own directory, so
    a run's directory still shows every step it ran."""
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(worker.job_dir, target_is_directory=True)
    except OSError:
        log.debug("warm: could not link %s to %s", link, worker.job_dir)


async def run_warm(worker: Launched, request: dict[str, Any], *, secret_env: dict[str, str],
                   timeout_s: float, on_progress: Progress | None = None) -> JobResult:
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
