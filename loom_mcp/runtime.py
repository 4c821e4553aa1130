"""The call runtime the server's tools share, apart from the MCP wiring: the services a call
uses (ledger, artifacts, config), a call's scope (device leases, metered seconds), recording
every call in the ledger before it runs and when it ends, and turning what went wrong into a
coded error (a full disk or a read-only LOOM_HOME anywhere in the call becomes [DISK_FULL] /
[READ_ONLY]; anything unexpected is logged with its traceback and reported as [INTERNAL]).
`loom-mcp check` uses it without MCP.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sqlite3
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from mcp.server.mcpserver.exceptions import ToolError

from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError, storage_error
from loom_mcp.sandbox import policy as sandbox_policy
from loom_mcp.sandbox.lease import DEVICE_METER
from loom_mcp.store import ArtifactStore, Ledger

log = logging.getLogger("loom_mcp")

T = TypeVar("T")
ToolArguments = dict[str, Any]  # a call's arguments by parameter name, as the ledger records them


@dataclass
class Services:
    config: LoomConfig
    ledger: Ledger
    artifacts: ArtifactStore


@dataclass
class CallScope:
    """Per-call accounting handed to domain code (device seconds come from leases held)."""

    campaign_id: str | None = None
    metered: list[float] = field(default_factory=list)  # every lease the call held (DEVICE_METER)


def _probe_writable(directory: Path) -> None:
    """Write, sync and remove a small file: a read-only or full LOOM_HOME fails here, at start,
    rather than in the middle of the first tool call."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=".loom-write-probe-")
    try:
        os.write(fd, b"loom-mcp write probe\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        Path(name).unlink(missing_ok=True)


def _remember_started_config(config: LoomConfig) -> None:
    """Keep a copy of the loom.toml this server started with (cache/loom.toml.last-start): a
    file that later fails to load, or changed between starts, can be diffed against it."""
    source = config.source
    if source is None or source.sha256 is None:
        return
    last = config.last_started_path
    try:
        previous = last.read_bytes() if last.is_file() else None
        current = source.path.read_bytes()
    except OSError:
        return
    import hashlib

    if hashlib.sha256(current).hexdigest() != source.sha256:
        return  # changed between load and now: drift() reports it; keep the older copy
    if previous is not None and previous != current:
        log.warning(
            "loom.toml changed since the last server started (sha256 %s -> %s); `diff %s %s` shows what changed",
            hashlib.sha256(previous).hexdigest()[:12],
            source.sha256[:12],
            last,
            source.path,
        )
    if previous != current:
        fd, tmp = tempfile.mkstemp(dir=last.parent, prefix=".last-start-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(current)
        os.replace(tmp, last)


def open_services(config: LoomConfig) -> Services:
    """Prepare LOOM_HOME and open the ledger. A read-only or full LOOM_HOME, or a ledger that is
    not a sound loom ledger, raises a coded LoomError (the command line prints it and exits)."""
    try:
        return _open_services(config)
    except LoomError:
        raise
    except (OSError, sqlite3.Error) as exc:
        coded = storage_error(exc, config.home)
        if coded is None:
            raise
        raise LoomError(coded.code, f"cannot start on LOOM_HOME {config.home}: {coded.message}") from exc


def _open_services(config: LoomConfig) -> Services:
    sandbox_policy.configure(config)  # job limits, trusted roots, LOOM_HOME hidden from jobs
    for directory in (config.home, config.jobs_dir, config.locks_dir, config.cache_dir):
        directory.mkdir(parents=True, exist_ok=True)
    _probe_writable(config.home)
    ledger = Ledger(config.ledger_path)
    _remember_started_config(config)
    if ledger.interrupted_on_open:
        log.warning("%d call(s) from a previous server were interrupted", ledger.interrupted_on_open)
    worktrees = config.home / "worktrees"
    if ledger.interrupted_submissions() or (
        worktrees.is_dir() and any(any(d.iterdir()) for d in worktrees.iterdir() if d.is_dir())
    ):
        from loom_mcp.submissions import recover_interrupted

        removed = recover_interrupted(config, ledger)
        if removed:
            log.warning("removed %d worktree(s) left by interrupted submissions", len(removed))
    from loom_mcp.bench.revisions import sweep_stale_revisions

    swept = sweep_stale_revisions(config.home)
    if swept:
        log.warning("removed %d revision checkout(s) left by a stopped server", len(swept))
    return Services(config=config, ledger=ledger, artifacts=ArtifactStore(config.artifacts_dir, ledger))


_drift_logged: set[str] = set()


def config_notes(services: Services) -> list[str]:
    """Warnings every result carries: loom.toml changed on disk since this server started."""
    note = services.config.drift()
    if note is None:
        return []
    if note not in _drift_logged:
        _drift_logged.add(note)
        log.warning("%s", note)
    return [note]


def campaign_rules_note(services: Services, campaign_id: str | None) -> list[str]:
    """The campaign was started under other rules than this server's (loom.toml changed and the
    server was restarted): the server's rules apply; say so."""
    if not campaign_id:
        return []
    try:
        row = services.ledger.campaign(campaign_id)
    except sqlite3.Error:
        return []
    now = services.config.fingerprint()
    if row is None or row["config_fingerprint"] == now:
        return []
    return [
        f"campaign {campaign_id} was started under config fingerprint {row['config_fingerprint']}; "
        f"this server enforces {now} (the human's loom.toml as of the server's start)"
    ]


def _with_notes(result: T, notes: list[str]) -> T:
    if notes and isinstance(getattr(result, "next_step", None), str):
        result.next_step = " ".join(f"WARNING: {n}." for n in notes) + " " + result.next_step  # type: ignore[attr-defined]
    return result


def _end_call(
    services: Services, call_id: int | None, outcome: str, scope: CallScope, error_code: str | None = None
) -> LoomError | None:
    """Record the end of a call; a ledger that can no longer be written must not hide the
    call's own outcome, so a failure here is logged and returned (coded when it is storage)."""
    if call_id is None:
        return None
    try:
        # Every lease the call held, a failed call's too (the campaign's budget counts it).
        services.ledger.end_call(
            call_id, outcome, error_code=error_code, device_s=sum(scope.metered), campaign_id=scope.campaign_id
        )
    except Exception as exc:  # reported, never raised over the call's own outcome
        coded = storage_error(exc, services.config.home)
        log.error("could not record the end of call %s in the ledger: %s", call_id, coded or exc)
        return coded or LoomError(ErrorCode.INTERNAL, f"ledger write failed ({type(exc).__name__})")
    return None


def _coded(exc: BaseException, services: Services) -> LoomError | None:
    """DISK_FULL / READ_ONLY for a storage fault anywhere in `exc`'s chain. A LoomError that a
    worker crash or an internal failure produced is re-coded when LOOM_HOME's filesystem is full or
    read-only now (a worker that could not write its output says only that it died)."""
    home = services.config.home
    coded = storage_error(exc, home)
    if coded is None and (not isinstance(exc, LoomError) or exc.code in (ErrorCode.WORKER_CRASHED, ErrorCode.INTERNAL)):
        from loom_mcp.errors import filesystem_state, storage_hint

        state = filesystem_state(home)
        if state is not None:
            what = "LOOM_HOME's filesystem is full" if state is ErrorCode.DISK_FULL else "LOOM_HOME is not writable"
            coded = LoomError(state, f"{what}; {storage_hint(state, home)}")
    if coded is not None and isinstance(exc, LoomError) and exc.code is not coded.code:
        coded = LoomError(coded.code, f"{coded.message} (the call failed with: {exc})")
    return coded


async def run_recorded(
    services: Services,
    tool: str,
    arguments: dict[str, Any],
    body: Callable[[CallScope], Awaitable[T]],
    campaign_id: str | None = None,
) -> T:
    """Ledger bookkeeping and error translation around one tool call."""
    scope = CallScope(campaign_id=campaign_id)
    try:
        call_id: int | None = services.ledger.begin_call(tool, arguments, campaign_id)
    except Exception as exc:
        coded = _coded(exc, services)
        if coded is None:
            log.exception("tool %s: the ledger refused the call", tool)
            raise ToolError(
                f"[INTERNAL] {tool} could not be recorded in the ledger "
                f"({type(exc).__name__}); the server log has details"
            ) from exc
        raise ToolError(f"{coded} ({tool} was not run: the ledger could not record it)") from exc
    DEVICE_METER.set(scope.metered)  # this call's task (and its children) only
    try:
        result = await body(scope)
    except LoomError as exc:
        error = _coded(exc, services) or exc
        lost = _end_call(services, call_id, "error", scope, error.code.value)
        notes = config_notes(services) + ([f"this outcome is not in the ledger: {lost}"] if lost else [])
        raise ToolError(" ".join([str(error), *(f"(WARNING: {n})" for n in notes)])) from exc
    except anyio.get_cancelled_exc_class():
        # Shielded: the ledger write must happen even though this task is being cancelled.
        with anyio.CancelScope(shield=True):
            _end_call(services, call_id, "cancelled", scope, ErrorCode.CANCELLED.value)
        raise
    except Exception as exc:
        coded = _coded(exc, services)
        if coded is not None:
            log.error("tool %s: %s", tool, coded)
            lost = _end_call(services, call_id, "error", scope, coded.code.value)
            extra = f" (this outcome is not in the ledger either: {lost.code.value})" if lost else ""
            raise ToolError(f"{coded}{extra}") from exc
        log.exception("tool %s failed", tool)
        _end_call(services, call_id, "error", scope, ErrorCode.INTERNAL.value)
        raise ToolError(
            f"[INTERNAL] {tool} failed unexpectedly ({type(exc).__name__}); the server log has details"
        ) from exc
    lost = _end_call(services, call_id, "ok", scope)
    notes = config_notes(services)
    if tool in ("submit_candidate", "campaign_report"):
        notes += campaign_rules_note(services, scope.campaign_id)
    if lost:
        notes.append(f"the ledger could not record this call's end ({lost}); the next start marks it interrupted")
    return _with_notes(result, notes)


# Parameters a tool may take that the server hands it, not the client (none is in its schema):
# `scope`, the call's accounting (start_campaign names the campaign it made there), and
# `arguments`, the call's own arguments as the ledger records them (every parameter but ctx),
# for a tool that passes each of them on unchanged.
HANDED = ("scope", "arguments")


def recorded(services: Services, tool: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """A tool written as `async def name(scope?, arguments?, ctx?, **parameters)` becomes the
    function an MCP server registers: the same parameters less the HANDED ones (the tool's schema
    is built from them), each call recorded in the ledger under `tool` with every parameter but
    ctx (run_recorded), under its campaign_id when it takes one."""

    def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        # eval_str: the server module's annotations are strings; the SDK reads this signature.
        signature = inspect.signature(fn, eval_str=True)
        handed = [name for name in HANDED if name in signature.parameters]
        public = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in HANDED])

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> T:
            bound = public.bind(*args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            arguments = {name: value for name, value in given.items() if name != "ctx"}

            def body(scope: CallScope) -> Awaitable[T]:
                server_side = {"scope": scope, "arguments": dict(arguments)}
                return fn(**{name: server_side[name] for name in handed}, **given)

            return await run_recorded(services, tool, arguments, body, given.get("campaign_id"))

        call.__signature__ = public  # type: ignore[attr-defined]
        return call

    return wrap
