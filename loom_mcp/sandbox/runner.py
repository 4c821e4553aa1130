"""Run one worker process in the sandbox and turn whatever happens to it into a JobResult.

Nothing here blocks the event loop: pipes are read as they fill (a worker blocked on a full
pipe would otherwise deadlock with a server waiting for it to exit), /proc scans and cgroup
work run in threads. Nothing is ever written to the server's stdout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from loom_mcp.errors import ErrorCode, LoomError, storage_error
from loom_mcp.sandbox import isolation, launcher, policy, procs, safefs, view
from loom_mcp.sandbox.disk import disk_usage
from loom_mcp.sandbox.env import worker_env
from loom_mcp.sandbox.job import JobResult, JobSpec, code_cache_env

log = logging.getLogger(__name__)

# Where a long step reports what it is doing (MCP progress notifications, logs): one type for all.
Progress = Callable[[str], Awaitable[None]]

MAX_RESULT_BYTES = 64 << 20
PROGRESS_EVERY_S = 1.0
# The heartbeat a running job sends every PROGRESS_EVERY_S; callers that relay it may prefix it
# ("baseline run 2/5: running 3.0 s"), so clients that thin it out match its end.
HEARTBEAT = re.compile(r"running \d+(\.\d+)? s$")


def heartbeat(elapsed_s: float) -> str:
    return f"running {elapsed_s:.1f} s"


# After the worker's tree is gone its pipes reach EOF at once; this only bounds the odd case
# of a descendant that escaped the tree and kept a pipe open.
_DRAIN_S = 2.0
_KILL_WAIT_S = 10.0
_CHUNK = 1 << 16


class _Tail:
    """The last `limit` bytes of a stream, and how many bytes went by."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._buf = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.limit <= 0:
            return
        self._buf += chunk
        # Trim only once the buffer doubles: amortized O(1) per byte, memory <= 2 * limit.
        if len(self._buf) > 2 * self.limit:
            del self._buf[: len(self._buf) - self.limit]

    def text(self) -> str:
        return bytes(self._buf[-self.limit :] if self.limit > 0 else b"").decode("utf-8", errors="replace")


class _Collect:
    """Everything from a pipe up to `limit` bytes; remembers whether it overflowed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.overflow = False
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        if len(self.data) + len(chunk) > self.limit:
            self.overflow = True
            return
        self.data += chunk


def _device_env(devices: list[int]) -> dict[str, str]:
    if not devices:
        # "-1" is an invalid ordinal for every runtime, so nothing is visible; an empty
        # string is treated as "unset" by some ROCm versions.
        return {
            "CUDA_VISIBLE_DEVICES": "-1",
            "HIP_VISIBLE_DEVICES": "-1",
            "ROCR_VISIBLE_DEVICES": "-1",
        }
    physical = ",".join(str(i) for i in devices)
    return {
        "CUDA_VISIBLE_DEVICES": physical,
        # ROCm filters twice: ROCR (physical ordinals) first, then HIP indexes what is left.
        # Pinning both to physical ordinals would hide device 1 behind ROCR=1,HIP=1.
        "ROCR_VISIBLE_DEVICES": physical,
        "HIP_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(devices))),
    }


def _prepare(spec: JobSpec, plan: dict[str, Any], memory_bytes: int) -> tuple[Path, Path, dict[str, str]]:
    """Blocking setup: job dir (and the job's private HOME in it), request file (if the spec has
    a request yet), job cgroups (pids and memory, where the plan uses them)."""
    job_dir = spec.job_dir.expanduser().resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "home").mkdir(exist_ok=True)
    request_path = job_dir / "request.json"
    if spec.request is not None:
        # A reused job directory is the job's: replace the name, never write through a link.
        safefs.write_text(job_dir, request_path.name, json.dumps(spec.request))
    max_tasks = spec.max_processes + launcher.LAUNCHER_TASKS if plan["limit_by"] == "cgroup" else None
    memory = memory_bytes if plan.get("memory") == "cgroup" else None
    cgroups = procs.create_job_cgroups(max_tasks, memory) if max_tasks or memory else {}
    return job_dir, request_path, cgroups


async def _pump_fd(fd: int, sink: _Tail | _Collect) -> None:
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not chunk:
            return
        sink.add(chunk)


async def _progress(callback: Progress, start: float) -> None:
    while True:
        await anyio.sleep(PROGRESS_EVERY_S)
        try:
            await callback(heartbeat(time.monotonic() - start))
        except Exception:
            # A failing progress sink must not take the job down with it.
            log.exception("progress callback failed")


def _parse_meta(raw: bytes) -> dict[str, Any]:
    applied: dict[str, Any] = {}
    for line in raw.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            applied.update(record.get("applied") or {})
            for key, value in (record.get("errors") or {}).items():
                # The root view failing where the probe built one is worth a line in the log:
                # the job ran with the read-only host tree instead.
                level = (
                    logging.WARNING
                    if key == "view"
                    and record.get("stage") == "init"
                    and (record.get("applied") or {}).get("view") != "allowlist"
                    else logging.DEBUG
                )
                log.log(level, "sandbox: %s not applied: %s", key, value)
    return applied


def _parse_result(sink: _Collect) -> tuple[dict[str, Any] | list[Any] | None, str | None]:
    if sink.overflow:
        return None, f"result larger than {MAX_RESULT_BYTES} bytes"
    if not sink.data:
        return None, None
    try:
        value = json.loads(bytes(sink.data))
    except ValueError as exc:
        return None, f"result is not valid JSON: {exc}"
    if not isinstance(value, (dict, list)):
        return None, f"result must be a JSON object or array, got {type(value).__name__}"
    return value, None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


@dataclass
class Launched:
    """A started launcher, not yet supervised. Plain file descriptors and a Popen, so it belongs
    to no event loop: a warm worker spawned in one call can be supervised in a later one."""

    spec: JobSpec
    process: subprocess.Popen
    job_dir: Path
    cgroups: dict[str, str]  # controller -> the job's cgroup directory
    result_r: int
    meta_r: int
    request_path: Path
    memory_bytes: int = 0  # the job's memory limit (0: none)
    disk_bytes: int = 0  # what `watched` may grow by (0: no quota)
    watched: tuple[Path, ...] = ()  # the job's writable directories
    # A pre-started worker (spawn(late=True)): the entries its root was built from, and the pipe
    # on which its init says whether a job's paths were added (warm.dispatch_late).
    view_ops: list[dict[str, Any]] | None = None
    ack_r: int | None = None
    born: float = 0.0  # time.monotonic() when it was started

    @property
    def cgroup(self) -> str | None:
        return next(iter(self.cgroups.values()), None)

    def alive(self) -> bool:
        return self.process.poll() is None

    def discard(self) -> None:
        """End an unsupervised launcher (a warm worker nobody will use) and release its fds."""
        if self.process.poll() is None:
            procs.kill_tree(self.process.pid, list(self.cgroups.values()))
        try:
            self.process.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        self._close()
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        for path in set(self.cgroups.values()):
            procs.remove_job_cgroup(path)

    def oom_kills(self) -> int:
        path = self.cgroups.get("memory")
        return procs.cgroup_oom_kills(path) if path else 0

    def _close(self) -> None:
        for fd in (self.result_r, self.meta_r, self.ack_r):
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def job_root(spec: JobSpec, job_dir: Path, writable: list[Path]) -> list[dict[str, Any]]:
    """The entries of `spec`'s own root (view.job_view), with `job_dir` as its directory: one
    place for a fresh job and a blank worker given the job (warm.dispatch_late), so the two
    roots never differ in more than the job's paths."""
    limits = policy.current()
    disk = limits.disk_bytes if spec.max_disk_bytes is None else spec.max_disk_bytes
    return view.job_view(
        job_dir=job_dir,
        readable=spec.readable,
        writable=writable,
        shm_dir=spec.shm_dir,
        tmp_bytes=disk or policy.DEFAULT_DISK_BYTES,
    )


def late_binds_possible(spec: JobSpec) -> bool:
    """Can `spec` run in a pre-started worker whose paths are added later? Only with a root of
    its own (the allowlist view) inside a pid namespace, whose init adds them."""
    plan = isolation.plan(isolation.capabilities(), allow_network=spec.allow_network)
    return bool(spec.readonly_fs and plan.get("view") and plan.get("late") and "pid" in plan["unshare"])


def spawn(spec: JobSpec, *, stdin_pipe: bool = False, late: bool = False) -> Launched:
    """Start `spec.argv` under the sandbox launcher and return at once (blocking: fork and exec).

    Call it from a thread that outlives the job (the event loop's): the launcher arms
    PR_SET_PDEATHSIG, which fires when the *thread* that forked it exits. Forked from a pooled
    worker thread, jobs were SIGKILLed when that thread idled out (seen on the H200 host: an arm
    mid-benchmark, then every reference step).

    With `stdin_pipe` the worker gets a pipe on stdin (a warm worker reads its job from it);
    otherwise /dev/null. The request file, if any, is written now. With `late` (which implies
    `stdin_pipe`; see late_binds_possible) that pipe leads to the job's init, which adds the
    job's own paths to the root when the job comes (warm.dispatch_late).
    """
    stdin_pipe = stdin_pipe or late
    caps = isolation.capabilities()
    plan = isolation.plan(caps, allow_network=spec.allow_network)
    limits = policy.current()
    memory = limits.memory_bytes if spec.max_memory_bytes is None else spec.max_memory_bytes
    disk = limits.disk_bytes if spec.max_disk_bytes is None else spec.max_disk_bytes
    try:
        job_dir, request_path, cgroups = _prepare(spec, plan, memory)
    except OSError as exc:
        # A full (or read-only) LOOM_HOME is a coded error the agent can act on, not a crash.
        coded = storage_error(exc, limits.loom_home)
        if coded is not None:
            raise coded from exc
        raise

    env = worker_env(spec.env)
    # The job's own directory, unless the caller names another it may write (torch's shared
    # memory manager puts its socket there, which the other processes of a benchmark connect to).
    tmp = spec.env.get("TMPDIR") or str(job_dir)
    env.update({"TMPDIR": tmp, "TMP": tmp, "TEMP": tmp})
    env["LOOM_JOB_DIR"] = str(job_dir)
    # Never the server's HOME (its credentials, caches and dotfiles): the job's own directory.
    env["HOME"] = str(job_dir / "home")
    if "XDG_CACHE_HOME" not in spec.env:
        env["XDG_CACHE_HOME"] = str(job_dir / "home" / ".cache")
    if spec.request is not None or stdin_pipe:  # a warm worker's request is written at dispatch
        env["LOOM_REQUEST"] = str(request_path)
    if spec.visible_devices is not None:
        env.update(_device_env(spec.visible_devices))

    writable = None
    root_view: dict[str, Any] | None = None
    extra = [Path(p).resolve() for p in spec.writable]
    if spec.readonly_fs:
        for extra_dir in extra:
            extra_dir.mkdir(parents=True, exist_ok=True)
        writable = [str(job_dir), *map(str, extra)]
        if os.path.isdir("/dev/shm"):
            writable.append("/dev/shm")
        # Triton and load_inline write their build caches; the shared ones under HOME are
        # read-only now, and sharing them would let one candidate plant binaries another job
        # loads.
        if "TRITON_CACHE_DIR" not in spec.env:
            (job_dir / "triton-cache").mkdir(exist_ok=True)
            env.update(code_cache_env(job_dir / "triton-cache"))
        if plan.get("view"):
            try:
                ops = job_root(spec, job_dir, extra)
            except BaseException:
                for path in set(cgroups.values()):
                    procs.remove_job_cgroup(path)
                raise
            root_view = {"ops": ops, "cwd": str(job_dir)}

    result_r, result_w = os.pipe()
    meta_r, meta_w = os.pipe()
    ack_r, ack_w = os.pipe() if late and root_view is not None else (None, None)
    env["LOOM_RESULT_FD"] = str(result_w)
    config = {
        "parent_pid": os.getpid(),
        "unshare": plan["unshare"],
        "nproc": spec.max_processes if plan["limit_by"] == "nproc" else None,
        "fsize": spec.max_file_bytes,
        "cgroups": cgroups,
        "memory_bytes": memory or None,
        "meta_fd": meta_w,
        "worker_fds": [result_w],
        "writable": writable,
        "view": root_view,
        "late": ack_w is not None,
        "ack_fd": ack_w,
    }
    # The plan travels in a memory file, not on the command line: the job's init is the
    # launcher, and its /proc/1/cmdline is readable from inside the job.
    config_fd = os.memfd_create("loom-launcher-config", 0)
    os.write(config_fd, json.dumps(config).encode())
    os.lseek(config_fd, 0, os.SEEK_SET)
    argv = [sys.executable, "-I", "-S", isolation.LAUNCHER, "--config-fd", str(config_fd), *spec.argv]
    passed = (result_w, meta_w, config_fd) if ack_w is None else (result_w, meta_w, ack_w, config_fd)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=job_dir,
            env=env,
            start_new_session=True,
            pass_fds=passed,
        )
    except OSError as exc:
        for fd in (result_r, meta_r, ack_r, config_fd):
            if fd is not None:
                os.close(fd)
        for path in set(cgroups.values()):
            procs.remove_job_cgroup(path)
        raise LoomError(ErrorCode.INTERNAL, f"cannot start the sandbox launcher: {exc}") from exc
    finally:
        # Only the child keeps the write ends: EOF then means "every writer is gone".
        for fd in (result_w, meta_w, ack_w, config_fd):
            if fd is not None:
                os.close(fd)
    assert process.stdout is not None and process.stderr is not None  # both PIPE above
    for fd in (result_r, meta_r, process.stdout.fileno(), process.stderr.fileno()):
        os.set_blocking(fd, False)
    return Launched(
        spec=spec,
        process=process,
        job_dir=job_dir,
        cgroups=cgroups,
        result_r=result_r,
        meta_r=meta_r,
        request_path=request_path,
        memory_bytes=memory,
        disk_bytes=disk,
        watched=(job_dir, *extra),
        view_ops=root_view["ops"] if ack_r is not None and root_view else None,
        ack_r=ack_r,
        born=time.monotonic(),
    )


async def _wait_exit(process: subprocess.Popen) -> None:
    """Until the process has exited (and is reaped), without a thread or a loop-bound watcher."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, or already reaped): poll
        while process.poll() is None:
            await anyio.sleep(0.01)
        return
    try:
        if process.poll() is None:
            await anyio.wait_readable(pidfd)
        process.wait()
    finally:
        os.close(pidfd)


async def _end_tree(launched: Launched) -> None:
    """SIGKILL the launcher's whole tree and reap the launcher."""
    if launched.process.poll() is None:
        await anyio.to_thread.run_sync(procs.kill_tree, launched.process.pid, list(launched.cgroups.values()))
    with anyio.move_on_after(_KILL_WAIT_S):
        await _wait_exit(launched.process)


_DISK_EVERY_S = 1.0


async def _watch_disk(launched: Launched, exceeded: anyio.Event) -> None:
    """Kill the job once its directories grew by more than its quota.

    About once a second, and never more than 5 % of the time spent scanning (a working tree
    with many files, in the agent's commands). RLIMIT_FSIZE bounds a single file; this bounds
    the total, so that a job cannot fill LOOM_HOME's disk, which every tool needs.
    """
    limit = launched.disk_bytes
    base = await anyio.to_thread.run_sync(disk_usage, launched.watched)
    while True:
        began = time.monotonic()
        used = await anyio.to_thread.run_sync(disk_usage, launched.watched, base + limit)
        if used - base > limit:
            exceeded.set()
            await _end_tree(launched)
            return
        await anyio.sleep(max(_DISK_EVERY_S, 20 * (time.monotonic() - began)))


# What an allocation refused under RLIMIT_DATA looks like from Python, torch and C++. Not "out
# of memory" alone: that is also how a full GPU reports, which is no limit of ours.
_ALLOC_REFUSED = re.compile(
    r"\bMemoryError\b|std::bad_alloc|Cannot allocate memory|can't allocate memory|"
    r"DefaultCPUAllocator|\bENOMEM\b"
)


async def supervise(launched: Launched, on_progress: Progress | None = None) -> JobResult:
    """Pump a launched job's pipes until it exits or `spec.timeout_s` passes (counted from now),
    and turn what happened into a JobResult. If the calling scope is cancelled, the worker's
    whole process tree is killed and reaped before the cancellation propagates."""
    spec, process = launched.spec, launched.process
    assert process.stdout is not None and process.stderr is not None  # launch() made both pipes
    out, err = _Tail(spec.max_output_bytes), _Tail(spec.max_output_bytes)
    result_sink, meta_sink = _Collect(MAX_RESULT_BYTES), _Collect(1 << 16)
    timed_out = False
    disk_exceeded = anyio.Event()
    oom_kills = 0
    start = time.monotonic()
    try:
        async with anyio.create_task_group() as tg:
            pumps_left = 4
            drained = anyio.Event()

            async def pump(fd: int, sink: _Tail | _Collect) -> None:
                nonlocal pumps_left
                try:
                    await _pump_fd(fd, sink)
                finally:
                    pumps_left -= 1
                    if pumps_left == 0:
                        drained.set()

            tg.start_soon(pump, process.stdout.fileno(), out)
            tg.start_soon(pump, process.stderr.fileno(), err)
            tg.start_soon(pump, launched.result_r, result_sink)
            tg.start_soon(pump, launched.meta_r, meta_sink)
            if on_progress is not None:
                tg.start_soon(_progress, on_progress, start)
            if launched.disk_bytes and launched.watched:
                tg.start_soon(_watch_disk, launched, disk_exceeded)

            with anyio.move_on_after(spec.timeout_s) as deadline:
                await _wait_exit(process)
            if deadline.cancelled_caught:
                timed_out = True
                await _end_tree(launched)
            with anyio.move_on_after(_DRAIN_S):
                await drained.wait()
            tg.cancel_scope.cancel()
    except BaseException:
        # Cancellation (or any failure) must not leave the worker running on the device.
        with anyio.CancelScope(shield=True):
            await _end_tree(launched)
        raise
    finally:
        launched._close()
        if launched.cgroups:
            with anyio.CancelScope(shield=True):
                oom_kills = await anyio.to_thread.run_sync(launched.oom_kills)
                await anyio.to_thread.run_sync(launched._remove_cgroups)
    wall_s = time.monotonic() - start

    rc = process.returncode
    returncode, sig = (None, _signal_name(-rc)) if rc is not None and rc < 0 else (rc, None)
    applied = _parse_meta(bytes(meta_sink.data))
    if not applied and rc == launcher.SETUP_FAILED:
        log.warning("sandbox setup failed: %s", err.text()[-500:])
    if len(result_sink.data) > _CHUNK:
        result, result_error = await anyio.to_thread.run_sync(_parse_result, result_sink)
    else:
        result, result_error = _parse_result(result_sink)
    marks = result.pop("marks", None) if isinstance(result, dict) else None
    memory_by = applied.get("memory")
    failed = rc != 0 or timed_out
    memory_exceeded = oom_kills > 0 or (
        memory_by == "rlimit" and failed and bool(_ALLOC_REFUSED.search(err.text()[-8192:]))
    )
    return JobResult(
        returncode=returncode,
        signal=sig,
        timed_out=timed_out,
        cancelled=False,
        wall_s=round(wall_s, 6),
        stdout_tail=out.text(),
        stderr_tail=err.text(),
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        result=result,
        result_error=result_error,
        marks=marks if isinstance(marks, dict) else None,
        network_isolated=bool(applied.get("net")),
        readonly_fs=bool(applied.get("readonly_fs")),
        view=applied.get("view") or "none",
        memory_limit=memory_by if memory_by in ("cgroup", "rlimit") else None,
        memory_limit_bytes=launched.memory_bytes or None,
        memory_exceeded=memory_exceeded,
        disk_limit_bytes=launched.disk_bytes or None,
        disk_exceeded=disk_exceeded.is_set(),
    )


def limit_error(job: JobResult, what: str) -> LoomError | None:
    """[RESOURCE_LIMIT] when `job` (named `what`: "the compile worker") ended on one of its
    resource limits; None otherwise. For callers whose job failing is a tool error; where the
    job is a candidate under judgement its failure is a finding (JobResult.failure says why)."""
    if job.limit_exceeded is None:
        return None
    return LoomError(ErrorCode.RESOURCE_LIMIT, f"{what} {job.limit_exceeded}")


async def run_job(spec: JobSpec, on_progress: Progress | None = None) -> JobResult:
    """Run `spec.argv` in the sandbox. Crashes, hangs and timeouts come back as a JobResult.

    If the calling scope is cancelled, the worker's whole process tree is killed and reaped
    before the cancellation propagates.
    """
    await anyio.to_thread.run_sync(isolation.capabilities)  # probed once, off the loop
    launched = spawn(spec)  # on the loop's thread: see spawn()
    return await supervise(launched, on_progress)
