"""benchmark, command mode: real commands through the real sandbox, metrics parsed from output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from loom_mcp.bench.command import benchmark_commands
from loom_mcp.bench.metrics import (
    detect_kind,
    last_json_object,
    metric_direction,
    parse_metric_specs,
    parse_output,
)
from loom_mcp.errors import ErrorCode, LoomError

PY = sys.executable
FIXTURES = Path(__file__).parent / "fixtures" / "bench_outputs"

# Prints a JSON line of a throughput and a latency, `speed` times the baseline's, with +-3 %
# noise drawn from a counter shared by both arms (so every run differs, yet every test run sees
# the same numbers), and fails on the runs listed in FAIL_ON (1-based, across both arms).
BENCH_SCRIPT = """\
import json, os, random, sys
from pathlib import Path
SPEED = {speed}
counter = Path(os.environ["BENCH_COUNTER"])
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
if str(n) in os.environ.get("FAIL_ON", "").split(","):
    sys.stderr.write(f"flaky failure on run {{n}}\\n")
    sys.exit(3)
rng = random.Random(n)
print("loading model... done")
print(json.dumps({{
    "tokens_per_s": 1000.0 * SPEED * (1 + rng.uniform(-0.03, 0.03)),
    "latency_ms": 50.0 / SPEED * (1 + rng.uniform(-0.03, 0.03)),
    "model": "tiny",
    "detail": {{"steps": 32, "peak_mem_mb": 512}},
}}))
print("bye")
"""


def _script(tmp_path: Path, name: str, speed: float) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(BENCH_SCRIPT.format(speed=speed))
    return path


def _cat(path: Path) -> list[str]:
    return [PY, "-c", "import sys; print(open(sys.argv[1]).read())", str(path)]


async def _bench(tmp_path: Path, baseline: list[str], candidate: list[str], **kw):
    args = {
        "metrics": None,
        "runs": 3,
        "job_dir": tmp_path / "job",
        "timeout_s": 30.0,
        "cwd": None,
        "env": None,
        "parser": "auto",
        # the scripts and their shared counter live in tmp_path (the server passes its roots)
        "readable": [tmp_path],
        "writable": [tmp_path],
    }
    args.update(kw)
    return await benchmark_commands(baseline=baseline, candidate=candidate, **args)


def _by_name(result) -> dict:
    return {m.name: m for m in result.metrics}


# ---------------------------------------------------------------- the A/B statistics


@pytest.mark.anyio
async def test_candidate_20_percent_better_on_both_directions(tmp_path: Path) -> None:
    base = _script(tmp_path, "baseline", 1.0)
    cand = _script(tmp_path, "candidate", 1.2)
    messages: list[str] = []

    async def progress(message: str) -> None:
        messages.append(message)

    # Relative script paths: the commands run in `cwd`, not in their run directories.
    result = await _bench(
        tmp_path,
        [PY, base.name],
        [PY, cand.name],
        runs=6,
        cwd=tmp_path,
        env={"BENCH_COUNTER": str(tmp_path / "counter")},
        progress=progress,
    )
    by = _by_name(result)
    # metrics=None on plain json: every numeric key whose direction the name tells.
    assert set(by) == {"tokens_per_s", "latency_ms"}
    tps, lat = by["tokens_per_s"], by["latency_ms"]
    assert tps.higher_is_better and not lat.higher_is_better
    for m in (tps, lat):
        assert 1.12 < m.ratio.estimate < 1.28
        assert m.ratio.ci_low > 1.0, m.ratio  # the CI excludes 1: a real improvement
        assert m.ratio.method == "paired_bootstrap"
        assert m.baseline.n == m.candidate.n == 6
        assert m.baseline_ci[0] <= m.baseline.median <= m.baseline_ci[1]
        assert m.candidate_ci[0] <= m.candidate.median <= m.candidate_ci[1]
    # The ratio is oriented per direction: candidate/baseline for throughput, the inverse
    # for latency; both read "> 1 = candidate better".
    assert tps.ratio.estimate == pytest.approx(tps.candidate.median / tps.baseline.median, rel=1e-3)
    assert lat.ratio.estimate == pytest.approx(lat.baseline.median / lat.candidate.median, rel=1e-3)
    assert result.runs_per_arm == 6 and result.failed_runs == []
    assert result.parser_used == "json"
    assert "candidate better on" in result.next_step
    assert sum("pair" in m for m in messages) == 6

    # ABBA: pairs alternate which arm goes first; every run is recorded.
    samples = json.loads(Path(result.samples_file).read_text())
    order = [r["arm"][0] for r in samples["runs"]]
    assert "".join(order) == "bccbbccbbccb"


@pytest.mark.anyio
async def test_a_vs_a_ci_includes_one(tmp_path: Path) -> None:
    same = _script(tmp_path, "same", 1.0)
    result = await _bench(
        tmp_path,
        [PY, str(same)],
        [PY, str(same)],
        runs=6,
        metrics=["tokens_per_s", "latency_ms"],
        env={"BENCH_COUNTER": str(tmp_path / "counter")},
        warmup=1,
    )
    samples = json.loads(Path(result.samples_file).read_text())
    assert [(r["arm"], r["run"]) for r in samples["runs"][:2]] == [
        ("baseline", 0),
        ("candidate", 0),
    ]
    assert result.runs_per_arm == 6 and len(samples["pairs"]) == 6
    for m in result.metrics:
        assert m.ratio.ci_low <= 1.0 <= m.ratio.ci_high, (m.name, m.ratio)
        assert 0.95 < m.ratio.estimate < 1.05
    assert "no clear difference" in result.next_step


@pytest.mark.anyio
async def test_flaky_run_is_recorded_and_its_pair_dropped(tmp_path: Path) -> None:
    base = _script(tmp_path, "baseline", 1.0)
    cand = _script(tmp_path, "candidate", 1.2)
    # Run 4 overall is pair 2's second run (baseline: pairs alternate b c | c b | b c ...).
    result = await _bench(
        tmp_path,
        [PY, str(base)],
        [PY, str(cand)],
        runs=5,
        metrics=["tokens_per_s"],
        env={"BENCH_COUNTER": str(tmp_path / "counter"), "FAIL_ON": "4"},
    )
    assert result.runs_requested == 5 and result.runs_per_arm == 4
    [failure] = result.failed_runs
    assert failure.arm == "baseline" and failure.run == 2
    assert "exit code 3" in failure.reason and "flaky failure" in failure.reason
    assert result.metrics[0].baseline.n == result.metrics[0].candidate.n == 4


@pytest.mark.anyio
async def test_too_many_failures_is_bad_input(tmp_path: Path) -> None:
    base = _script(tmp_path, "baseline", 1.0)
    cand = _script(tmp_path, "candidate", 1.2)
    with pytest.raises(LoomError) as err:
        await _bench(
            tmp_path,
            [PY, str(base)],
            [PY, str(cand)],
            runs=5,
            env={"BENCH_COUNTER": str(tmp_path / "counter"), "FAIL_ON": "3,5,6"},
        )
    assert err.value.code == ErrorCode.BAD_INPUT
    assert "2 runs failed, more than the 1 allowed" in err.value.message


# ---------------------------------------------------------------- vLLM and SGLang outputs


@pytest.mark.anyio
async def test_vllm_result_json(tmp_path: Path) -> None:
    result = await _bench(
        tmp_path,
        _cat(FIXTURES / "vllm_serve_baseline.json"),
        _cat(FIXTURES / "vllm_serve_candidate.json"),
    )
    assert result.parser_used == "vllm"
    by = _by_name(result)
    assert list(by) == [
        "output_throughput",
        "total_token_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
    ]
    base = json.loads((FIXTURES / "vllm_serve_baseline.json").read_text())
    cand = json.loads((FIXTURES / "vllm_serve_candidate.json").read_text())
    out = by["output_throughput"]
    assert out.higher_is_better
    assert out.baseline.median == pytest.approx(base["output_throughput"], rel=1e-3)
    assert out.ratio.estimate == pytest.approx(
        cand["output_throughput"] / base["output_throughput"], rel=1e-3
    )
    ttft = by["median_ttft_ms"]
    assert not ttft.higher_is_better
    assert ttft.ratio.estimate == pytest.approx(
        base["median_ttft_ms"] / cand["median_ttft_ms"], rel=1e-3
    )
    # Identical runs: no spread, every CI collapses onto its estimate.
    assert out.ratio.ci_low == out.ratio.ci_high == out.ratio.estimate
    assert out.baseline_ci == [out.baseline.median] * 2 and out.baseline.std == 0.0
    assert len(result.model_dump_json()) < 4096, len(result.model_dump_json())


@pytest.mark.anyio
async def test_vllm_via_metrics_file_in_cwd(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    # Like `vllm bench serve --save-result --result-filename result.json`: a table on stdout,
    # the JSON in a file in the working directory.
    fake = [
        PY,
        "-c",
        "import shutil, sys; print(open(sys.argv[1]).read()); shutil.copy(sys.argv[2], 'result.json')",
        str(FIXTURES / "vllm_serve_stdout.txt"),
    ]
    result = await _bench(
        tmp_path,
        [*fake, str(FIXTURES / "vllm_serve_baseline.json")],
        [*fake, str(FIXTURES / "vllm_serve_candidate.json")],
        cwd=work,
        metrics_file="result.json",
        metrics=["output_throughput", "p99_tpot_ms"],
        parser="vllm",
    )
    assert result.parser_used == "vllm"
    assert [m.name for m in result.metrics] == ["output_throughput", "p99_tpot_ms"]
    assert all(m.ratio.estimate > 1.1 for m in result.metrics)
    # Consumed after every run: not left in cwd, kept in each run's directory.
    assert not (work / "result.json").exists()
    assert len(list((tmp_path / "job").glob("*/metrics-result.json"))) == 6

    # A leftover file would be read as the first run's result: refused up front.
    (work / "result.json").write_text("{}")
    with pytest.raises(LoomError) as err:
        await _bench(
            tmp_path, fake, fake, cwd=work, metrics_file="result.json", job_dir=tmp_path / "j2"
        )
    assert err.value.code == ErrorCode.BAD_INPUT and "exists before the first run" in str(err.value)


@pytest.mark.anyio
async def test_vllm_failed_requests_fail_the_run(tmp_path: Path) -> None:
    with pytest.raises(LoomError) as err:
        await _bench(
            tmp_path,
            _cat(FIXTURES / "vllm_serve_baseline.json"),
            _cat(FIXTURES / "vllm_serve_failed_requests.json"),
        )
    assert err.value.code == ErrorCode.BAD_INPUT
    assert (
        "candidate run 1" in err.value.message and "37 of 200 requests failed" in err.value.message
    )


@pytest.mark.anyio
async def test_sglang_bench_serving_last_record(tmp_path: Path) -> None:
    result = await _bench(
        tmp_path,
        _cat(FIXTURES / "sglang_serving_baseline.jsonl"),
        _cat(FIXTURES / "sglang_serving_candidate.jsonl"),
    )
    assert result.parser_used == "sglang"
    by = _by_name(result)
    assert {"output_throughput", "input_throughput", "median_e2e_latency_ms"} <= set(by)
    last = json.loads((FIXTURES / "sglang_serving_baseline.jsonl").read_text().splitlines()[-1])
    assert by["output_throughput"].baseline.median == pytest.approx(
        last["output_throughput"], rel=1e-3
    )
    assert by["median_e2e_latency_ms"].ratio.estimate > 1  # lower latency: candidate better
    # request_rate is Infinity in the record: fine unless asked for, then a clear error.
    with pytest.raises(LoomError) as err:
        await _bench(
            tmp_path,
            _cat(FIXTURES / "sglang_serving_baseline.jsonl"),
            _cat(FIXTURES / "sglang_serving_candidate.jsonl"),
            metrics=["request_rate:higher"],
            job_dir=tmp_path / "j2",
        )
    assert "'request_rate' is inf" in err.value.message and "baseline run 1" in err.value.message


@pytest.mark.anyio
async def test_sglang_one_batch_records_prefixed_by_batch_size(tmp_path: Path) -> None:
    result = await _bench(
        tmp_path,
        _cat(FIXTURES / "sglang_one_batch_baseline.jsonl"),
        _cat(FIXTURES / "sglang_one_batch_candidate.jsonl"),
        parser="sglang",
        metrics=["bs8.median_decode_throughput", "bs1.median_decode_latency"],
    )
    by = _by_name(result)
    assert by["bs8.median_decode_throughput"].higher_is_better
    assert not by["bs1.median_decode_latency"].higher_is_better
    assert by["bs1.median_decode_latency"].ratio.estimate == pytest.approx(
        0.00731 / 0.00612, rel=1e-3
    )


# ---------------------------------------------------------------- failures


@pytest.mark.anyio
async def test_nonzero_exit_on_first_run_is_bad_input(tmp_path: Path) -> None:
    ok = _cat(FIXTURES / "vllm_serve_baseline.json")
    broken = [PY, "-c", "import sys; sys.stderr.write('CUDA out of memory\\n'); sys.exit(2)"]
    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, ok, broken)
    assert err.value.code == ErrorCode.BAD_INPUT
    msg = err.value.message
    assert "candidate run 1/3" in msg and "exit code 2" in msg and "CUDA out of memory" in msg

    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, ["no-such-benchmark-tool"], ok, job_dir=tmp_path / "j2")
    assert "baseline run 1/3" in err.value.message and "exit code 127" in err.value.message
    assert "cannot execute" in err.value.message


@pytest.mark.anyio
async def test_timeout_on_first_run_is_bad_input(tmp_path: Path) -> None:
    slow = [PY, "-c", "import time; time.sleep(30)"]
    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, slow, slow, timeout_s=0.5)
    assert err.value.code == ErrorCode.BAD_INPUT
    assert "baseline run 1/3" in err.value.message and "timed out after 0.5 s" in err.value.message


@pytest.mark.anyio
async def test_missing_metric_names_run_and_metric(tmp_path: Path) -> None:
    base = _script(tmp_path, "baseline", 1.0)
    with pytest.raises(LoomError) as err:
        await _bench(
            tmp_path,
            [PY, str(base)],
            [PY, str(base)],
            metrics=["tokens_per_s", "kv_cache_hit_rate:higher"],
            env={"BENCH_COUNTER": str(tmp_path / "counter")},
        )
    assert err.value.code == ErrorCode.BAD_INPUT
    msg = err.value.message
    assert "baseline run 1" in msg and "'kv_cache_hit_rate'" in msg
    assert "tokens_per_s" in msg and "detail.steps" in msg  # what is there, flattened


@pytest.mark.anyio
async def test_non_numeric_metric_and_no_json(tmp_path: Path) -> None:
    base = _script(tmp_path, "baseline", 1.0)
    env = {"BENCH_COUNTER": str(tmp_path / "counter")}
    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, [PY, str(base)], [PY, str(base)], metrics=["model:higher"], env=env)
    assert "metric 'model' is a string ('tiny'), not a number" in err.value.message

    quiet = [PY, "-c", "print('done in 3.2 s')"]
    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, quiet, quiet, job_dir=tmp_path / "j2")
    assert "baseline run 1/3: stdout has no JSON object" in err.value.message


@pytest.mark.anyio
async def test_unknown_direction_refused_before_running(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    touch = [PY, "-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(LoomError) as err:
        await _bench(tmp_path, touch, touch, metrics=["steps"])
    assert "'steps:higher' or 'steps:lower'" in err.value.message
    assert not marker.exists()


# ---------------------------------------------------------------- parsing units


def test_direction_table() -> None:
    higher = ["output_throughput", "tokens_per_s", "tok_s", "gen.tokens/s", "tflops", "req_qps"]
    lower = ["median_ttft_ms", "p99_e2el_ms", "duration", "prefill_latency", "step_time", "wall_s"]
    assert all(metric_direction(n) is True for n in higher)
    assert all(metric_direction(n) is False for n in lower)
    assert metric_direction("num_warps") is None and metric_direction("completed") is None
    assert parse_metric_specs(["x:lower", "step_ms"]) == [("x", False), ("step_ms", False)]


def test_json_extraction() -> None:
    pretty = 'log\n{\n  "a": {"b": 2},\n  "c": 1\n}\ntrailing log line\n'
    assert last_json_object(pretty) == {"a": {"b": 2}, "c": 1}
    assert last_json_object('{"x": 1}\nnoise\n{"x": 2}\n{broken\n') == {"x": 2}
    assert last_json_object("no json here") is None
    parsed = parse_output('{"a": {"b": 2, "c": [1, 2]}, "d": true}', "json")
    assert parsed.values == {"a.b": 2, "a.c": [1, 2], "d": True}
    vllm = json.loads((FIXTURES / "vllm_serve_baseline.json").read_text())
    assert detect_kind(vllm) == "vllm"
    with pytest.raises(ValueError, match="does not look like sglang"):
        parse_output(json.dumps(vllm), "sglang")
