"""benchmark, command mode: A/B of two commands whose output carries the metrics.

Each command runs `runs` times in the sandbox, a fresh process per run, in ABBA order (pair i runs
the baseline first when i is even), so a linear drift (warming device, filling caches, a neighbour
ramping up) costs both arms alike. Pair i is (baseline run i, candidate run i): paired statistics.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio.to_thread
from pydantic import ValidationError

from loom_mcp.bench.command_models import Arm, CommandBenchmarkResult, RunFailure
from loom_mcp.bench.command_report import command_findings, compare, next_step
from loom_mcp.bench.command_runs import (
    Bench,
    Run,
    _read_metrics,
    check_metrics_file,
    work_tree,
    write_samples,
)
from loom_mcp.bench.metrics import (
    Kind,
    ParserName,
    available_metrics,
    default_metrics,
    metric_direction,
    parse_metric_specs,
)
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import GateConfig
from loom_mcp.sandbox import JobSpec, policy, safefs
from loom_mcp.sandbox.runner import Progress

__all__ = ["_read_metrics", "benchmark_commands"]  # _read_metrics: tests import it from here

MIN_RUNS = 3
MAX_RUNS = 200
MAX_WARMUP = 10


async def benchmark_commands(
    *,
    baseline: list[str],
    candidate: list[str],
    metrics: list[str] | None,
    runs: int,
    job_dir: Path,
    timeout_s: float,
    cwd: Path | Mapping[Arm, Path] | None,
    parser: ParserName,
    env: dict[str, str] | None = None,
    progress: Progress | None = None,
    metrics_file: str | None = None,
    warmup: int = 0,
    allow_network: bool = False,
    gate: GateConfig | None = None,
    readable: Sequence[Path] | None = None,
    writable: Sequence[Path] = (),
    visible_devices: list[int] | None = None,
) -> CommandBenchmarkResult:
    """Run `baseline` and `candidate` `runs` times each in ABBA order and compare their metrics.

    `cwd`: where both commands run, or one directory per arm (say, two git revisions' worktrees:
    bench/revisions.py). `timeout_s` bounds each run. `warmup` unrecorded runs per arm go first
    (page cache, JIT and compile caches). `allow_network` lets runs reach beyond their own
    loopback (benchmarking a server started outside the run); the caller decides whether that
    is allowed. `gate` supplies the CI level, bootstrap resamples and seed (defaults: 95 %, 5000,
    0). `metrics_file` and the runs: bench/command_runs.py; parsers: bench/metrics.py; what is
    reported per metric: bench/command_report.py.

    What the commands see (the sandbox's root view): `readable` read-only (default: the
    server's allowed roots), each arm's working tree (`work_tree(cwd)`) and `writable`
    read-write, their run directory (cwd when none is given, HOME) read-write. `visible_devices`:
    the GPUs (physical indices) the commands see; None leaves the server's setting.

    Metrics and direction: ``metrics`` names what to compare; ``"name:higher"`` / ``"name:lower"``
    states the direction. Without a suffix the direction comes from a table of known names (vLLM,
    SGLang), then from the name: throughput, goodput, bandwidth, speedup, accuracy, flops,
    ``*_per_s``, ``*tok_s``, ``*/s`` and the whole words tps/qps/rps are higher-is-better;
    ``*_ms``/``*_s``/``*_us``/``*_ns``, latency, duration, elapsed and the whole words ttft, tpot,
    itl, e2el, time are lower-is-better. A metric whose direction cannot be told is refused before
    anything runs. ``metrics=None`` picks the parser's headline metrics (vLLM / SGLang), or every
    numeric key of known direction (json), present and positive in the first run of both arms, at
    most 8 (each metric costs ~460 bytes of result).

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
    rel = check_metrics_file(metrics_file) if metrics_file is not None else None
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

    bench = Bench(
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
        visible_devices=visible_devices,
        readable=[Path(p) for p in (policy.current().trusted_roots if readable is None else readable)],
        writable={
            arm: [*([work_tree(where)] if where is not None else []), *map(Path, writable)]
            for arm, where in run_cwds.items()
        },
    )
    for _ in range(warmup):
        for arm in ("baseline", "candidate"):
            await bench.say(f"{arm} warmup")
            done = await bench.run(arm, 0)
            if done.failure:  # unreachable for first runs, which raise; kept for later warmups
                raise LoomError(ErrorCode.BAD_INPUT, f"{arm} warmup failed: {done.failure}")

    max_failures = max(1, runs // 5)
    failures: list[Run] = []
    pairs: list[dict[Arm, Run]] = []
    chosen: list[tuple[str, bool]] | None = specs
    for i in range(runs):
        order: tuple[Arm, Arm] = ("baseline", "candidate") if i % 2 == 0 else ("candidate", "baseline")
        pair: dict[Arm, Run] = {}
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
    comparisons = [compare(name, higher, pairs, gate) for name, higher in chosen]
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
    await anyio.to_thread.run_sync(write_samples, samples_file, bench, chosen, pairs, parser_used, failures)
    findings = command_findings(comparisons, pairs, kinds)
    return CommandBenchmarkResult(
        metrics=comparisons,
        runs_per_arm=len(pairs),
        runs_requested=runs,
        failed_runs=[RunFailure(arm=f.arm, run=f.index, reason=(f.failure or "")[:240]) for f in failures],
        parser_used=parser_used,
        findings=findings,
        samples_file=str(samples_file),
        seconds=round(time.monotonic() - started, 3),
        next_step=next_step(comparisons, len(pairs)),
    )


def _choose(pair: dict[Arm, Run]) -> list[tuple[str, bool]]:
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


def _pair_line(index: int, runs: int, pair: dict[Arm, Run], chosen: list[tuple[str, bool]]) -> str:
    shown = []
    for name, _ in chosen[:2]:
        b, c = pair["baseline"].values[name], pair["candidate"].values[name]
        shown.append(f"{name} {b:.4g} -> {c:.4g}")
    walls = f"{pair['baseline'].wall_s:.1f}/{pair['candidate'].wall_s:.1f} s"
    return f"pair {index}/{runs} done ({walls}): " + "; ".join(shown)
