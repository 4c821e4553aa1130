"""The runs of a command benchmark: one sandboxed process per run, its exit judged, its output
(stdout or a metrics_file) read and parsed, and every run recorded.

``metrics_file``: vLLM and SGLang write their JSON to a file, not to stdout. ``metrics_file`` is
a path relative to the run's working directory (``cwd`` when given, else the run's own fresh
directory, which is also its TMPDIR), read instead of stdout. With ``cwd``, the file must not
exist before the first run (a stale result would be read as fresh: [BAD_INPUT]); after every run
it is moved into that run's directory under the job dir, so the next run starts without it and
each run's raw output is kept. Without ``cwd``, every run writes into its own directory anyway.
"""

from __future__ import annotations

import json
import logging
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import anyio.to_thread

from loom_mcp.bench.command_models import Arm
from loom_mcp.bench.metrics import OutputError, ParsedOutput, ParserName, metric_value, parse_output
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import JobResult, JobSpec, limit_error, policy, run_job, safefs
from loom_mcp.sandbox.runner import Progress

log = logging.getLogger("loom_mcp.bench.command")  # the command mode's one logger

# vLLM/SGLang print progress bars and tables before their JSON; a --save-detailed result holds
# per-request lists. 4 MiB of stdout tail and 64 MiB of file cover both with room.
MAX_STDOUT_BYTES = 4 << 20
MAX_METRICS_FILE_BYTES = 64 << 20
_STDERR_IN_ERROR = 600

# Runs python itself (not a shell) to enter `cwd`, then becomes the command. JobSpec has no cwd:
# the run directory is the worker's cwd and TMPDIR. Python ignores SIGPIPE and SIGXFSZ and
# ignored signals survive exec, so the defaults are restored first, as the sandbox launcher does.
_CHDIR_EXEC = """\
import os, signal, sys
for s in (signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(s, signal.SIG_DFL)
os.chdir(sys.argv[1])
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"cannot execute {sys.argv[2]!r}: {exc.strerror}\\n")
sys.exit(127)
"""


@dataclass
class Run:
    """One run of one arm, as samples.json records it."""

    arm: Arm
    index: int  # 1-based within the arm; 0 for warmup
    seq: int
    wall_s: float
    status: str
    failure: str | None = None
    parsed: ParsedOutput | None = None
    values: dict[str, float] = field(default_factory=dict)


def _status(res: JobResult, timeout_s: float) -> str:
    if res.timed_out:
        return f"timed out after {timeout_s:g} s"
    if res.signal:
        return f"killed by {res.signal}"
    return f"exit code {res.returncode}"


def _stderr_tail(res: JobResult, limit: int = _STDERR_IN_ERROR) -> str:
    tail = res.stderr_tail.strip() or res.stdout_tail.strip()
    if not tail:
        return ""
    return " …" + tail[-limit:] if len(tail) > limit else " " + tail


def check_metrics_file(metrics_file: str) -> PurePosixPath:
    rel = PurePosixPath(metrics_file.replace("\\", "/"))
    if not metrics_file or rel.is_absolute() or ".." in rel.parts or "\0" in metrics_file:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            f"metrics_file must be a relative path inside the run's directory, got {metrics_file!r}",
        )
    return rel


def _read_metrics(base: Path, rel: PurePosixPath) -> bytes | None:
    """The metrics file's bytes, None when there is none. Read beneath `base` without following
    a link, as a regular file of at most MAX_METRICS_FILE_BYTES (a FIFO would hang the server)."""
    st = safefs.lstat(base, rel)
    if st is None or stat.S_ISDIR(st.st_mode):
        return None
    try:
        return safefs.read_bytes(base, rel, MAX_METRICS_FILE_BYTES)
    except safefs.UnsafeFileError as exc:
        raise OutputError(exc.message) from exc


def work_tree(cwd: Path) -> Path:
    """What a command run in `cwd` may write: the top of the git working tree `cwd` lies in
    (builds write beside the sources: build/ at the top, a cmake cache), else `cwd` itself.

    Only within the allowed roots or the server's own checkouts (LOOM_HOME/worktrees: the
    revisions mode), and never a home directory or one of its parents (a dotfiles repository
    in $HOME would otherwise make all of it writable)."""
    limits = policy.current()
    inside = [*limits.trusted_roots, *([limits.loom_home / "worktrees"] if limits.loom_home else [])]
    home = Path.home().resolve()
    for top in (cwd, *cwd.parents):
        if (top / ".git").exists():
            if top != home and top not in home.parents and any(top == root or root in top.parents for root in inside):
                return top
            break
    return cwd


@dataclass(kw_only=True)
class Bench:
    """One command-mode benchmark's runs: starting them, parsing, the first-run failure policy."""

    commands: dict[Arm, list[str]]
    runs: int
    job_dir: Path
    timeout_s: float
    cwds: dict[Arm, Path | None]
    env: dict[str, str]
    parser: ParserName
    metrics_file: PurePosixPath | None
    allow_network: bool
    progress: Progress | None
    readable: list[Path] = field(default_factory=list)
    writable: dict[Arm, list[Path]] = field(default_factory=dict)
    visible_devices: list[int] | None = None  # the leased GPU; None: the server's setting
    seq: int = field(default=0, init=False)
    attempts: dict[Arm, int] = field(init=False, default_factory=lambda: {"baseline": 0, "candidate": 0})
    history: list[Run] = field(init=False, default_factory=list)

    async def say(self, message: str) -> None:
        if self.progress is None:
            return
        try:
            await self.progress(message)
        except Exception:
            # A failing progress sink must not take the benchmark down with it.
            log.exception("progress callback failed")

    def _argv(self, arm: Arm) -> list[str]:
        argv, cwd = self.commands[arm], self.cwds[arm]
        if cwd is None:
            return list(argv)
        return [sys.executable, "-I", "-S", "-c", _CHDIR_EXEC, str(cwd), *argv]

    async def run(self, arm: Arm, index: int) -> Run:
        self.seq += 1
        self.attempts[arm] += 1
        label = f"{arm} run {index}/{self.runs}" if index else f"{arm} warmup"
        run_dir = self.job_dir / f"{self.seq:03d}-{arm}-{index or 'warmup'}"
        spec = JobSpec(
            argv=self._argv(arm),
            job_dir=run_dir,
            timeout_s=self.timeout_s,
            env=self.env,
            max_output_bytes=MAX_STDOUT_BYTES,
            allow_network=self.allow_network,
            # The agent's own commands (servers, builds) run in the sandbox's root view like any
            # job: the allowed roots readable, the working tree and the run's directory writable,
            # HOME private, LOOM_HOME (ledger, loom.toml) and the real HOME out of sight.
            readable=self.readable,
            writable=self.writable.get(arm, []),
            visible_devices=self.visible_devices,
        )

        async def tick(message: str) -> None:
            await self.say(f"{label}: {message}")

        res = await run_job(spec, on_progress=tick if self.progress else None)
        if (over := limit_error(res, label)) is not None:
            # Not flaky and not the command's output: the server's limits (loom.toml) say no.
            raise over
        record = Run(arm, index, self.seq, res.wall_s, _status(res, self.timeout_s))
        self.history.append(record)
        text, source = await self._collect(res, run_dir, self.cwds[arm])
        if not res.ok:
            record.failure = record.status + _stderr_tail(res, 200)
            if self.attempts[arm] == 1:
                raise LoomError(
                    ErrorCode.BAD_INPUT,
                    f"{label} failed ({record.status}) on its first run, so the command is "
                    f"broken rather than flaky:{_stderr_tail(res)}",
                )
            return record
        if text is None:
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{label} exited 0 but did not write metrics_file {str(self.metrics_file)!r} "
                f"(looked in {self.cwds[arm] or 'the run directory'})",
            )
        try:
            record.parsed = parse_output(text, self.parser)
        except OutputError as exc:
            raise LoomError(ErrorCode.BAD_INPUT, f"{label}: {source} {exc}") from exc
        if record.parsed.problem:
            record.failure = record.parsed.problem
            if self.attempts[arm] == 1:
                raise LoomError(ErrorCode.BAD_INPUT, f"{label}: {record.parsed.problem}")
        return record

    async def _collect(self, res: JobResult, run_dir: Path, cwd: Path | None) -> tuple[str | None, str]:
        """The text to parse and where it came from; moves a metrics_file out of `cwd`."""
        if self.metrics_file is None:
            return res.stdout_tail, "stdout"
        source = f"metrics_file {str(self.metrics_file)!r}"
        base = cwd or run_dir
        try:
            data = await anyio.to_thread.run_sync(_read_metrics, base, self.metrics_file)
        except OutputError as exc:
            raise LoomError(ErrorCode.BAD_INPUT, f"{source}: {exc}") from exc
        if data is None:
            return None, source
        if cwd is not None:
            # Consumed: the next run must write its own, and this run's output is kept (the
            # bytes read, written anew: no link of the command's is followed either way).
            kept = f"metrics-{self.metrics_file.name}"
            await anyio.to_thread.run_sync(safefs.write_bytes, run_dir, kept, data)
            await anyio.to_thread.run_sync(safefs.unlink, cwd, self.metrics_file)
        return data.decode("utf-8", errors="replace"), source

    def check_values(self, record: Run, metrics: Iterable[str]) -> None:
        assert record.parsed is not None
        label = f"{record.arm} run {record.index}"
        where = "stdout" if self.metrics_file is None else f"metrics_file {str(self.metrics_file)!r}"
        for name in metrics:
            try:
                record.values[name] = metric_value(record.parsed.values, name)
            except OutputError as exc:
                raise LoomError(ErrorCode.BAD_INPUT, f"{label}: {where} {exc}") from exc


def write_samples(
    path: Path,
    bench: Bench,
    chosen: list[tuple[str, bool]],
    pairs: list[dict[Arm, Run]],
    parser_used: str,
    failures: list[Run],
) -> None:
    """Every run's parsed values, exit status and wall time, and which runs were paired, to
    `path` (the job dir's samples.json)."""
    record = {
        "baseline_command": bench.commands["baseline"],
        "candidate_command": bench.commands["candidate"],
        "cwd": {arm: str(where) if where else None for arm, where in bench.cwds.items()},
        "metrics_file": str(bench.metrics_file) if bench.metrics_file else None,
        "parser_used": parser_used,
        "metrics": [{"name": n, "higher_is_better": h} for n, h in chosen],
        "runs": [
            {
                "seq": r.seq,
                "arm": r.arm,
                "run": r.index,
                "status": r.status,
                "wall_s": r.wall_s,
                "failure": r.failure,
                "values": r.values,
            }
            for r in bench.history
        ],
        "pairs": [{"baseline": p["baseline"].seq, "candidate": p["candidate"].seq} for p in pairs],
        "failed": [f.seq for f in failures],
    }
    safefs.write_text(path.parent, path.name, json.dumps(record, indent=1))
