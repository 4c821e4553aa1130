"""Run one worker process in the sandbox and turn whatever happens to it into a JobResult.

Nothing here blocks the event loop: pipes are read as they fill (a worker blocked on a full
pipe would otherwise deadlock with a server waiting for it to exit), /proc scans and cgroup
work run in threads. Nothing is ever written to the server's stdout.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import isolation
from loom_mcp.sandbox.env import worker_env
from loom_mcp.sandbox.job import JobResult, JobSpec

log = logging.getLogger(__name__)

ProgressCallback = Callable[[str], Awaitable[None]]

MAX_RESULT_BYTES = 64 << 20
PROGRESS_EVERY_S = 1.0
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
        return bytes(self._buf[-self.limit :] if self.limit > 0 else b"").decode(
            "utf-8", errors="replace"
        )


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


def _prepare(spec: JobSpec, plan: dict[str, Any]) -> tuple[Path, Path | None, str | None]:
    """Blocking setup (runs in a thread): job dir, request file, pids cgroup."""
    job_dir = spec.job_dir.expanduser().resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    request_path = None
    if spec.request is not None:
        request_path = job_dir / "request.json"
        request_path.write_text(json.dumps(spec.request))
    cgroup = None
    if plan["limit_by"] == "cgroup":
        cgroup = isolation.create_job_cgroup(spec.max_processes + isolation.LAUNCHER_TASKS)
    return job_dir, request_path, cgroup


async def _pump_stream(stream: anyio.abc.ByteReceiveStream | None, sink: _Tail) -> None:
    if stream is None:
        return
    try:
        async for chunk in stream:
            sink.add(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


async def _pump_fd(fd: int, sink: _Collect) -> None:
    while True:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not chunk:
            return
        sink.add(chunk)


async def _progress(callback: ProgressCallback, start: float) -> None:
    while True:
        await anyio.sleep(PROGRESS_EVERY_S)
        try:
            await callback(f"running {time.monotonic() - start:.1f} s")
        except Exception:
            # A failing progress sink must not take the job down with it.
            log.exception("progress callback failed")


async def _end_tree(process: anyio.abc.Process, cgroup: str | None) -> None:
    """SIGKILL the launcher's whole tree and reap the launcher."""
    if process.returncode is None:
        await anyio.to_thread.run_sync(isolation.kill_tree, process.pid, cgroup)
    with anyio.move_on_after(_KILL_WAIT_S):
        await process.wait()


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
                log.debug("sandbox: %s not applied: %s", key, value)
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


async def run_job(spec: JobSpec, on_progress: ProgressCallback | None = None) -> JobResult:
    """Run `spec.argv` in the sandbox. Crashes, hangs and timeouts come back as a JobResult.

    If the calling scope is cancelled, the worker's whole process tree is killed and reaped
    before the cancellation propagates.
    """
    caps = await anyio.to_thread.run_sync(isolation.capabilities)
    plan = isolation.plan(caps, allow_network=spec.allow_network)
    job_dir, request_path, cgroup = await anyio.to_thread.run_sync(_prepare, spec, plan)

    env = worker_env(spec.env)
    env.update({"TMPDIR": str(job_dir), "TMP": str(job_dir), "TEMP": str(job_dir)})
    env["LOOM_JOB_DIR"] = str(job_dir)
    if request_path is not None:
        env["LOOM_REQUEST"] = str(request_path)
    if spec.visible_devices is not None:
        env.update(_device_env(spec.visible_devices))

    writable = None
    if spec.readonly_fs:
        writable = [str(job_dir), *(str(Path(p).resolve()) for p in spec.writable)]
        if os.path.isdir("/dev/shm"):
            writable.append("/dev/shm")
        # Triton writes its compile cache; the shared one under HOME is read-only now, and
        # sharing it would let one candidate plant binaries another job loads.
        if "TRITON_CACHE_DIR" not in spec.env:
            (job_dir / "triton-cache").mkdir(exist_ok=True)
            env["TRITON_CACHE_DIR"] = str(job_dir / "triton-cache")

    result_r, result_w = os.pipe()
    meta_r, meta_w = os.pipe()
    env["LOOM_RESULT_FD"] = str(result_w)
    config = {
        "parent_pid": os.getpid(),
        "unshare": plan["unshare"],
        "nproc": spec.max_processes if plan["limit_by"] == "nproc" else None,
        "fsize": spec.max_file_bytes,
        "cgroup": cgroup,
        "meta_fd": meta_w,
        "worker_fds": [result_w],
        "writable": writable,
    }
    argv = [sys.executable, "-I", "-S", isolation.LAUNCHER, json.dumps(config), *spec.argv]

    out, err = _Tail(spec.max_output_bytes), _Tail(spec.max_output_bytes)
    result_sink, meta_sink = _Collect(MAX_RESULT_BYTES), _Collect(1 << 16)
    timed_out = False
    process: anyio.abc.Process | None = None
    start = time.monotonic()
    try:
        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=job_dir,
                env=env,
                start_new_session=True,
                pass_fds=(result_w, meta_w),
            )
        except OSError as exc:
            raise LoomError(
                ErrorCode.INTERNAL, f"cannot start the sandbox launcher: {exc}"
            ) from exc
        finally:
            # Only the child keeps the write ends: EOF then means "every writer is gone".
            os.close(result_w)
            os.close(meta_w)
        os.set_blocking(result_r, False)
        os.set_blocking(meta_r, False)

        async with anyio.create_task_group() as tg:
            pumps_left = 4
            drained = anyio.Event()

            async def pump(func: Callable[..., Awaitable[None]], *args: Any) -> None:
                nonlocal pumps_left
                try:
                    await func(*args)
                finally:
                    pumps_left -= 1
                    if pumps_left == 0:
                        drained.set()

            tg.start_soon(pump, _pump_stream, process.stdout, out)
            tg.start_soon(pump, _pump_stream, process.stderr, err)
            tg.start_soon(pump, _pump_fd, result_r, result_sink)
            tg.start_soon(pump, _pump_fd, meta_r, meta_sink)
            if on_progress is not None:
                tg.start_soon(_progress, on_progress, start)

            with anyio.move_on_after(spec.timeout_s) as deadline:
                await process.wait()
            if deadline.cancelled_caught:
                timed_out = True
                await _end_tree(process, cgroup)
            with anyio.move_on_after(_DRAIN_S):
                await drained.wait()
            tg.cancel_scope.cancel()
    except BaseException:
        # Cancellation (or any failure) must not leave the worker running on the device.
        if process is not None:
            with anyio.CancelScope(shield=True):
                await _end_tree(process, cgroup)
        raise
    finally:
        os.close(result_r)
        os.close(meta_r)
        with anyio.CancelScope(shield=True):
            if process is not None:
                with anyio.move_on_after(_KILL_WAIT_S):
                    await process.aclose()
            if cgroup is not None:
                await anyio.to_thread.run_sync(isolation.remove_job_cgroup, cgroup)
    wall_s = time.monotonic() - start

    rc = process.returncode
    returncode, sig = (None, _signal_name(-rc)) if rc is not None and rc < 0 else (rc, None)
    applied = _parse_meta(bytes(meta_sink.data))
    if not applied and rc == isolation.SETUP_FAILED:
        log.warning("sandbox setup failed: %s", err.text()[-500:])
    if len(result_sink.data) > _CHUNK:
        result, result_error = await anyio.to_thread.run_sync(_parse_result, result_sink)
    else:
        result, result_error = _parse_result(result_sink)
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
        network_isolated=bool(applied.get("net")),
        readonly_fs=bool(applied.get("readonly_fs")),
    )
