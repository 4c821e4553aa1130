"""benchmark, command mode: A/B of two commands whose output carries the metrics.

Each command runs `runs` times in the sandbox, a fresh process per run, alternating in ABBA order
(pair i runs baseline then candidate when i is even, candidate then baseline when it is odd), so
a linear drift (warming device, filling caches, a neighbour ramping up) costs both arms alike.
Pair i is (baseline run i, candidate run i); statistics are paired, as in the kernel benchmark.

The metrics and how they are read: `bench/metrics.py`.

Working directory: ``cwd`` for both arms, or one per arm: the server's ``benchmark_command`` runs
one command at two git revisions that way, each in its own worktree (`bench/revisions.py`).

``metrics_file``: vLLM and SGLang write their JSON to a file, not to stdout. ``metrics_file`` is
a path relative to the run's working directory (``cwd`` when given, else the run's own fresh
directory, which is also its TMPDIR), read instead of stdout. With ``cwd``, the file must not
exist before the first run (a stale result would be read as fresh: [BAD_INPUT]); after every run
it is moved into that run's directory under the job dir, so the next run starts without it and
each run's raw output is kept. Without ``cwd``, every run writes into its own directory anyway.

Metrics and direction: ``metrics`` names what to compare; ``"name:higher"`` / ``"name:lower"``
states the direction. Without a suffix the direction comes from a table of known names (vLLM,
SGLang), then from the name: throughput, goodput, bandwidth, speedup, accuracy, flops,
``*_per_s``, ``*tok_s``, ``*/s`` and the whole words tps/qps/rps are higher-is-better;
``*_ms``/``*_s``/``*_us``/``*_ns``, latency, duration, elapsed and the whole words ttft, tpot,
itl, e2el, time are lower-is-better. A metric whose direction cannot be told is refused before
anything runs. ``metrics=None`` picks the parser's headline metrics (vLLM / SGLang), or every
numeric key of known direction (json), present and positive in the first run of both arms, at
most 8 (each metric costs ~460 bytes of result).

Per metric and arm: a SampleSummary (median, mean, std, ...; four significant digits) and the
bootstrap CI of the median (``baseline_ci`` / ``candidate_ci``) at the gate's CI level.

The ratio is an improvement factor, > 1 meaning the candidate is better: candidate/baseline of
the medians for a higher-is-better metric, baseline/candidate for a lower-is-better one. Both
come from `stats.ratio_ci` (median(first)/median(second), paired bootstrap over the same pair
indices), called as ``ratio_ci(candidate, baseline)`` for throughputs and ``ratio_ci(baseline,
candidate)`` for times: swapping the arms, not inverting the values, because the median of
reciprocals is not the reciprocal of the median for an even number of runs.

Failures (decided here):

* A command whose first run fails (non-zero exit, signal, timeout, vLLM/SGLang failed requests)
  is broken, not flaky: [BAD_INPUT] at once, with the exit status and the end of its stderr.
  Warmup runs are first runs.
* A later failed run is recorded in ``failed_runs``, its pair is dropped (a partner that has not
  run yet is skipped), and the benchmark goes on with fewer pairs (``runs_per_arm``). More than
  ``max(1, runs // 5)`` failed runs: [BAD_INPUT] listing them.
* Output that cannot be read (no JSON, a missing metric, a value that is not a positive finite
  number, a missing ``metrics_file``) is deterministic, never flaky: [BAD_INPUT] at once, naming
  the arm, the run and the metric, and listing the metrics that are there.

Every run's parsed values, exit status and wall time go to ``<job_dir>/samples.json``.
"""

from __future__ import annotations

import json
import logging
import math
import stat
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

import anyio.to_thread
import numpy as np
from pydantic import ValidationError

from loom_mcp.bench.metrics import (
    Kind,
    OutputError,
    ParsedOutput,
    ParserName,
    available_metrics,
    default_metrics,
    metric_direction,
    metric_value,
    parse_metric_specs,
    parse_output,
)
from loom_mcp.bench.stats import ratio_ci, summarize
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import Finding, GateConfig, RatioCI, SampleSummary
from loom_mcp.sandbox import JobResult, JobSpec, limit_error, policy, run_job, safefs
from loom_mcp.sandbox.runner import Progress

log = logging.getLogger(__name__)

Arm = Literal["baseline", "candidate"]

MIN_RUNS = 3
MAX_RUNS = 200
MAX_WARMUP = 10
# vLLM/SGLang print progress bars and tables before their JSON; a --save-detailed result holds
# per-request lists. 4 MiB of stdout tail and 64 MiB of file cover both with room.
MAX_STDOUT_BYTES = 4 << 20
MAX_METRICS_FILE_BYTES = 64 << 20
# Four significant digits (0.1 %) are finer than any run-to-run noise a command shows, and keep
# ten metrics near 4 KB.
_SIG_DIGITS = 4
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


# ---------------------------------------------------------------- result models


from loom_mcp.bench.command_models import CommandBenchmarkResult, MetricComparison, RunFailure  # noqa: E402

# ---------------------------------------------------------------- running


@dataclass
class _Run:
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


def _sig(x: float, digits: int = _SIG_DIGITS) -> float:
    return float(f"{x:.{digits}g}") if math.isfinite(x) and x != 0 else x


def _compact_summary(s: SampleSummary) -> SampleSummary:
    # Spreads below float rounding of the median (identical runs) are reported as exact zeros.
    tiny = 1e-9 * abs(s.median)
    update = {k: _sig(getattr(s, k)) for k in ("median", "mean", "min", "max")}
    for k in ("std", "stderr", "iqr", "mad"):
        value = getattr(s, k)
        update[k] = 0.0 if abs(value) <= tiny else _sig(value)
    return s.model_copy(update=update)


def median_ci(samples: Sequence[float], gate: GateConfig) -> list[float]:
    """Percentile bootstrap CI of one arm's median, widened to hold the median itself."""
    x = np.asarray(samples, dtype=np.float64)
    median = float(np.median(x))
    if x.size < 2:
        return [median, median]
    rng = np.random.default_rng([gate.bootstrap_seed, x.size])
    idx = rng.integers(0, x.size, size=(gate.bootstrap_resamples, x.size))
    alpha = 1.0 - gate.ci_level
    lo, hi = np.quantile(np.median(x[idx], axis=1), [alpha / 2, 1 - alpha / 2])
    return [_sig(min(float(lo), median)), _sig(max(float(hi), median))]


def _compact_ratio(r: RatioCI) -> RatioCI:
    return r.model_copy(update={k: _sig(getattr(r, k)) for k in ("estimate", "ci_low", "ci_high")})


def _check_metrics_file(metrics_file: str) -> PurePosixPath:
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
            if top != home and top not in home.parents and any(
                    top == root or root in top.parents for root in inside):
                return top
            break
    return cwd


class _Bench:
    """One command-mode benchmark: runs, parsing, failure policy, then statistics."""

    def __init__(
        self,
        *,
        commands: dict[Arm, list[str]],
        runs: int,
        job_dir: Path,
        timeout_s: float,
        cwds: dict[Arm, Path | None],
        env: dict[str, str],
        parser: ParserName,
        metrics_file: PurePosixPath | None,
        allow_network: bool,
        progress: Progress | None,
        readable: list[Path] | None = None,
        writable: dict[Arm, list[Path]] | None = None,
    ) -> None:
        self.commands = commands
        self.readable = readable or []
        self.writable = writable or {}
        self.runs = runs
        self.job_dir = job_dir
        self.timeout_s = timeout_s
        self.cwds = cwds
        self.env = env
        self.parser = parser
        self.metrics_file = metrics_file
        self.allow_network = allow_network
        self.progress = progress
        self.seq = 0
        self.attempts: dict[Arm, int] = {"baseline": 0, "candidate": 0}
        self.history: list[_Run] = []

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

    async def run(self, arm: Arm, index: int) -> _Run:
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
        )

        async def tick(message: str) -> None:
            await self.say(f"{label}: {message}")

        res = await run_job(spec, on_progress=tick if self.progress else None)
        if (over := limit_error(res, label)) is not None:
            # Not flaky and not the command's output: the server's limits (loom.toml) say no.
            raise over
        record = _Run(arm, index, self.seq, res.wall_s, _status(res, self.timeout_s))
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

    async def _collect(
        self, res: JobResult, run_dir: Path, cwd: Path | None
    ) -> tuple[str | None, str]:
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

    def check_values(self, record: _Run, metrics: Iterable[str]) -> None:
        assert record.parsed is not None
        label = f"{record.arm} run {record.index}"
        where = (
            "stdout" if self.metrics_file is None else f"metrics_file {str(self.metrics_file)!r}"
        )
        for name in metrics:
            try:
                record.values[name] = metric_value(record.parsed.values, name)
            except OutputError as exc:
                raise LoomError(ErrorCode.BAD_INPUT, f"{label}: {where} {exc}") from exc


async def benchmark_commands(
    *,
    baseline: list[str],
    candidate: list[str],
    metrics: list[str] | None,
    runs: int,
    job_dir: Path,
    timeout_s: float,
    cwd: Path | Mapping[Arm, Path] | None,
    env: dict[str, str] | None,
    parser: ParserName,
    progress: Progress | None = None,
    metrics_file: str | None = None,
    warmup: int = 0,
    allow_network: bool = False,
    gate: GateConfig | None = None,
    readable: Sequence[Path] | None = None,
    writable: Sequence[Path] = (),
) -> CommandBenchmarkResult:
    """Run `baseline` and `candidate` `runs` times each in ABBA order and compare their metrics.

    `cwd`: where both commands run, or one directory per arm (say, two git revisions' worktrees).
    `timeout_s` bounds each run. `warmup` unrecorded runs per arm go first (page cache, JIT and
    compile caches). `allow_network` lets runs reach beyond their own loopback (benchmarking a
    server started outside the run); the caller decides whether that is allowed. `gate` supplies
    the CI level, bootstrap resamples and seed (defaults: 95 %, 5000, 0). See the module
    docstring for parsing, direction and the failure policy.

    What the commands see (the sandbox's root view): `readable` read-only (default: the
    server's allowed roots), each arm's working tree (`work_tree(cwd)`) and `writable`
    read-write, their run directory (cwd when none is given, HOME) read-write.
    """
    started = time.monotonic()
    gate = gate or GateConfig()
    arm: Arm  # the loops below walk the two arms
    for arm, argv in (("baseline", baseline), ("candidate", candidate)):
        if not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise LoomError(ErrorCode.BAD_INPUT, f"{arm} command must be a non-empty argv list")
        if any("\0" in a for a in argv):
            raise LoomError(ErrorCode.BAD_INPUT, f"{arm} command contains a NUL byte")
    if not MIN_RUNS <= runs <= MAX_RUNS:
        raise LoomError(ErrorCode.BAD_INPUT, f"runs must be {MIN_RUNS}..{MAX_RUNS}, got {runs}")
    if not 0 <= warmup <= MAX_WARMUP:
        raise LoomError(ErrorCode.BAD_INPUT, f"warmup must be 0..{MAX_WARMUP}, got {warmup}")
    if not timeout_s > 0:
        raise LoomError(ErrorCode.BAD_INPUT, f"timeout_s must be positive, got {timeout_s}")
    if parser not in ("auto", "json", "vllm", "sglang"):
        raise LoomError(ErrorCode.BAD_INPUT, f"unknown parser {parser!r}")
    specs = parse_metric_specs(metrics) if metrics else None
    given: dict[Arm, Path | None] = (
        {"baseline": cwd.get("baseline"), "candidate": cwd.get("candidate")}
        if isinstance(cwd, Mapping)
        else {"baseline": cwd, "candidate": cwd}
    )
    run_cwds: dict[Arm, Path | None] = {}
    for arm, where in given.items():
        resolved = None if where is None else Path(where).expanduser().resolve()
        if resolved is not None and not resolved.is_dir():
            raise LoomError(ErrorCode.NOT_FOUND, f"cwd {resolved} is not a directory")
        run_cwds[arm] = resolved
    rel = _check_metrics_file(metrics_file) if metrics_file is not None else None
    stale = [w for w in run_cwds.values() if w is not None and rel is not None]
    for where in stale:
        assert rel is not None
        if safefs.exists(where, rel):  # a link counts: nothing is followed
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"metrics_file {where / rel} exists before the first run: remove it, so a stale "
                "result cannot pass for a fresh one",
            )
    job_dir = Path(job_dir).expanduser().resolve()
    try:  # the env is the same for every run: refuse a bad one before anything runs
        JobSpec(argv=list(baseline), job_dir=job_dir, env=dict(env or {}))
    except ValidationError as exc:
        raise LoomError(ErrorCode.BAD_INPUT, f"env: {exc.errors()[0]['msg']}") from exc
    job_dir.mkdir(parents=True, exist_ok=True)

    bench = _Bench(
        commands={"baseline": list(baseline), "candidate": list(candidate)},
        runs=runs,
        job_dir=job_dir,
        timeout_s=timeout_s,
        cwds=run_cwds,
        env=dict(env or {}),
        parser=parser,
        metrics_file=rel,
        allow_network=allow_network,
        progress=progress,
        readable=[Path(p) for p in (policy.current().trusted_roots if readable is None else readable)],
        writable={arm: [*([work_tree(where)] if where is not None else []), *map(Path, writable)]
                  for arm, where in run_cwds.items()},
    )
    for _ in range(warmup):
        for arm in ("baseline", "candidate"):
            await bench.say(f"{arm} warmup")
            done = await bench.run(arm, 0)
            if done.failure:  # unreachable for first runs, which raise; kept for later warmups
                raise LoomError(ErrorCode.BAD_INPUT, f"{arm} warmup failed: {done.failure}")

    max_failures = max(1, runs // 5)
    failures: list[_Run] = []
    pairs: list[dict[Arm, _Run]] = []
    chosen: list[tuple[str, bool]] | None = specs
    for i in range(runs):
        order: tuple[Arm, Arm] = (
            ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
        )
        pair: dict[Arm, _Run] = {}
        for arm in order:
            record = await bench.run(arm, i + 1)
            if record.failure:
                failures.append(record)
                await bench.say(f"{arm} run {i + 1}/{runs} failed: {record.failure[:120]}")
                if len(failures) > max_failures:
                    listed = "; ".join(f"{f.arm} run {f.index}: {f.failure}" for f in failures)
                    raise LoomError(
                        ErrorCode.BAD_INPUT,
                        f"{len(failures)} runs failed, more than the {max_failures} allowed "
                        f"in {runs} pairs: {listed[:1500]}",
                    )
                break  # the pair is lost: its partner run would measure nothing usable
            pair[arm] = record
        else:
            if chosen is None:
                chosen = _choose(pair)
            for record in pair.values():
                bench.check_values(record, (name for name, _ in chosen))
            pairs.append(pair)
            await bench.say(_pair_line(i + 1, runs, pair, chosen))

    assert chosen is not None  # pair 0 always completes or raises
    comparisons = [_compare(name, higher, pairs, gate) for name, higher in chosen]
    kinds: dict[Arm, Kind] = {}
    for arm in ("baseline", "candidate"):
        parsed = pairs[0][arm].parsed
        assert parsed is not None  # kept pairs hold parsed runs only
        kinds[arm] = parsed.kind
    parser_used = (
        kinds["baseline"]
        if kinds["baseline"] == kinds["candidate"]
        else f"baseline={kinds['baseline']} candidate={kinds['candidate']}"
    )
    samples_file = job_dir / "samples.json"
    await anyio.to_thread.run_sync(
        _write_samples, samples_file, bench, chosen, pairs, parser_used, failures
    )
    findings = _findings(comparisons, pairs, kinds)
    return CommandBenchmarkResult(
        metrics=comparisons,
        runs_per_arm=len(pairs),
        runs_requested=runs,
        failed_runs=[
            RunFailure(arm=f.arm, run=f.index, reason=(f.failure or "")[:240]) for f in failures
        ],
        parser_used=parser_used,
        findings=findings,
        samples_file=str(samples_file),
        seconds=round(time.monotonic() - started, 3),
        next_step=_next_step(comparisons, len(pairs)),
    )


def _choose(pair: dict[Arm, _Run]) -> list[tuple[str, bool]]:
    first, second = pair["baseline"].parsed, pair["candidate"].parsed
    assert first is not None and second is not None
    names = default_metrics(first.kind, first.values, second.values)
    if not names:
        raise LoomError(
            ErrorCode.BAD_INPUT,
            "no metric to compare was found in both arms' first runs; name them with "
            f"metrics=[...] (baseline has: {available_metrics(first.values)})",
        )
    return [(name, bool(metric_direction(name))) for name in names]


def _pair_line(index: int, runs: int, pair: dict[Arm, _Run], chosen: list[tuple[str, bool]]) -> str:
    shown = []
    for name, _ in chosen[:2]:
        b, c = pair["baseline"].values[name], pair["candidate"].values[name]
        shown.append(f"{name} {b:.4g} -> {c:.4g}")
    walls = f"{pair['baseline'].wall_s:.1f}/{pair['candidate'].wall_s:.1f} s"
    return f"pair {index}/{runs} done ({walls}): " + "; ".join(shown)


def _compare(
    name: str, higher: bool, pairs: list[dict[Arm, _Run]], gate: GateConfig
) -> MetricComparison:
    b = [p["baseline"].values[name] for p in pairs]
    c = [p["candidate"].values[name] for p in pairs]
    # ratio_ci returns median(first)/median(second): candidate first for throughputs, baseline
    # first for times, so the estimate is always "> 1 = candidate better".
    first, second = (c, b) if higher else (b, c)
    ci = ratio_ci(
        first,
        second,
        level=gate.ci_level,
        resamples=gate.bootstrap_resamples,
        seed=gate.bootstrap_seed,
    )
    return MetricComparison(
        name=name,
        higher_is_better=higher,
        baseline=_compact_summary(summarize(b)),
        baseline_ci=median_ci(b, gate),
        candidate=_compact_summary(summarize(c)),
        candidate_ci=median_ci(c, gate),
        ratio=_compact_ratio(ci),
    )


def _findings(
    comparisons: list[MetricComparison], pairs: list[dict[Arm, _Run]], kinds: dict[Arm, Kind]
) -> list[Finding]:
    findings: list[Finding] = []
    if len(pairs) < 5:
        findings.append(
            Finding(
                check="bench.command.few_runs",
                severity="warning",
                message=f"only {len(pairs)} pairs: the CIs are rough; 5 or more pairs are better",
            )
        )
    noisy = [
        m.name
        for m in comparisons
        if m.ratio.ci_low <= 1 <= m.ratio.ci_high
        and any(s.mean > 0 and s.std / s.mean > 0.05 for s in (m.baseline, m.candidate))
    ]
    if noisy:
        findings.append(
            Finding(
                check="bench.command.noisy",
                severity="warning",
                message="runs vary by more than 5 % and the CI spans 1 on "
                + ", ".join(noisy[:5])
                + ": add runs, lengthen each run, or quiet the machine",
            )
        )
    if kinds["baseline"] != kinds["candidate"]:
        findings.append(
            Finding(
                check="bench.command.parsers_differ",
                severity="warning",
                message=f"baseline output reads as {kinds['baseline']}, candidate as "
                f"{kinds['candidate']}: same-named metrics may not be defined alike",
            )
        )
    return findings


def _next_step(comparisons: list[MetricComparison], pairs: int) -> str:
    def names(ms: list[MetricComparison]) -> str:
        shown = ", ".join(f"{m.name} x{m.ratio.estimate:.3g}" for m in ms[:4])
        return shown + (f" (+{len(ms) - 4} more)" if len(ms) > 4 else "")

    better = [m for m in comparisons if m.ratio.ci_low > 1]
    worse = [m for m in comparisons if m.ratio.ci_high < 1]
    unclear = [m for m in comparisons if m not in better and m not in worse]
    parts = []
    if better:
        parts.append(f"candidate better on {names(better)}")
    if worse:
        parts.append(f"worse on {names(worse)}")
    if unclear:
        parts.append(
            f"no clear difference on {names(unclear)} (CI spans 1; {pairs} pairs): add runs "
            "if a small change matters"
        )
    return "; ".join(parts) + ". Ratios are improvement factors (> 1 = candidate better)."


def _write_samples(
    path: Path,
    bench: _Bench,
    chosen: list[tuple[str, bool]],
    pairs: list[dict[Arm, _Run]],
    parser_used: str,
    failures: list[_Run],
) -> None:
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
