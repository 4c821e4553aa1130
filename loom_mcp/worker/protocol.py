"""Worker side of the sandbox protocol: read the request, send one result on the private pipe.

Imported inside worker processes, before torch and friends: standard library only.
The result goes to the file descriptor named by LOOM_RESULT_FD, never to stdout — stdout is
free-form log output that the server keeps only a bounded tail of.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

REQUEST_ENV = "LOOM_REQUEST"
RESULT_FD_ENV = "LOOM_RESULT_FD"

_sent = False
# Wall-clock moments of this worker's life (epoch seconds), sent with its result, so the server
# can say where a step's time went: imports, waiting, work.
_marks: dict[str, float] = {}
PR_SET_DUMPABLE = 4


def mark(name: str) -> None:
    _marks[name] = time.time()


def read_request() -> dict[str, Any] | None:
    """The JSON request the server wrote for this job, or None if there is none."""
    _protect_result_fd()
    path = os.environ.get(REQUEST_ENV)
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else None


def send_result(obj: Any) -> None:
    """Send `obj` as JSON to the server. Once per process; the pipe is closed afterwards."""
    global _sent
    if _sent:
        raise RuntimeError("send_result() may be called only once per worker")
    fd = _result_fd()
    if fd is None:
        raise RuntimeError(f"{RESULT_FD_ENV} is not set: not running under the loom sandbox")
    if isinstance(obj, dict):
        obj = {**obj, "marks": {**_marks, "result": time.time()}}
    # Serialize before claiming the pipe so that an unserializable object can be fixed and
    # sent again.
    data = json.dumps(obj, separators=(",", ":")).encode()
    _sent = True
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)


def forbid_inspection() -> bool:
    """Make this process non-dumpable: another process of the same user, without
    CAP_SYS_PTRACE (every job drops its capabilities), can then neither ptrace it nor read its
    memory or environment under /proc. The trusted reference holds the answers while the
    candidate runs; where the sandbox could not give the candidate its own pid namespace, this
    is what keeps it from reading them. True if it took effect (Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# The streams as this module found them: a candidate that swaps sys.stdout for an object of its
# own must not get to run code (rewriting its saved outputs) in the flush before the exit.
_STREAMS = (sys.stdout, sys.stderr)


def exit_now(code: int = 0) -> None:
    """End the worker without the interpreter's teardown: everything it owes is sent or on disk,
    and unwinding torch, Triton and a device context took seconds on the critical path."""
    for stream in _STREAMS:
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _result_fd() -> int | None:
    raw = os.environ.get(RESULT_FD_ENV)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _protect_result_fd() -> None:
    """Keep the result pipe out of programs the worker executes (compilers, profilers).

    A stray copy would keep the pipe open after the worker is done; the server would still
    finish (it ends the whole process tree), but only after the worker's children exit.
    """
    fd = _result_fd()
    if fd is not None:
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass


_protect_result_fd()


def publish_go(path: str, payload: dict[str, Any], token: str) -> None:
    """Atomically write a go-file signed with `token`, which only the waiting worker and its
    publisher hold (see harness.wait_for_go). Used by the server and by the trusted worker that
    tells the candidate its inputs are written."""
    import hashlib
    import hmac

    body = json.dumps(payload)
    mac = hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"payload": body, "mac": mac}))
    os.rename(tmp, path)


# CUDA IPC keys what a process exports by its pid (a /dev/shm file named after it), and every
# sandboxed worker starts as pid 2 of its own pid namespace: two arms exported the same event
# handle (the timer waited on the wrong arm's event) and collided with the timer's. Each process
# of a benchmark takes a pid of its own before it imports anything that starts threads (a thread
# takes a pid too), so in a fresh namespace the numbers below are exact.
# The trusted reference takes one too: validation lends a candidate device memory by CUDA IPC
# (loom_mcp.worker.cuda_ipc), and the candidate starts as pid 2 of its own namespace.
BENCH_PIDS = {"baseline": 3, "candidate": 4, "timer": 5, "reference": 6}


def take_pid(target: int) -> None:
    """Continue in a descendant whose pid is at least `target` (pids are handed out in order in
    a fresh pid namespace); each process left behind waits and exits as its child did. A no-op
    outside a pid namespace, where pids are distinct anyway. Call it before torch is imported."""
    while 1 < os.getpid() < target:
        child = os.fork()
        if child:
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # die of the same signal: a SIGKILL is how the server tells an OOM kill
                if -code not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code if code >= 0 else 128 - code)


def take_bench_pid(role: str) -> None:
    """take_pid for the benchmark process this one is, by its role ("timer" for the timer)."""
    take_pid(BENCH_PIDS.get(role, 0))


def request_role() -> str:
    """The role named in this worker's request, read without importing anything heavy."""
    request = read_request() or {}
    return str(request.get("role") or "")
