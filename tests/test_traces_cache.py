"""Cached analysis (second call within a second, no re-hash) and the large-trace generator."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import loom_mcp.traces.cache as cache
from loom_mcp.traces import analyze_trace_cached, analyze_trace_file, trace_content_hash

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "traces_real"
SYNTH = REPO / "tests" / "fixtures" / "traces_synthetic"
needs_fixtures = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason="shared trace fixtures not present"
)


def test_content_hash_is_of_bytes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(b"[1, 2]")
    b.write_bytes(b"[1, 2]")
    assert trace_content_hash(a) == trace_content_hash(b)
    b.write_bytes(b"[1, 3]")
    assert trace_content_hash(a) != trace_content_hash(b)


@needs_fixtures
def test_second_cached_call_is_fast_and_does_not_rehash(tmp_path, monkeypatch):
    trace = FIXTURES / "h100_qwen1.5_0.5b_chat.json.gz"
    root = tmp_path / "cache"
    first = analyze_trace_cached(trace, top_k=10, cache_root=root)
    assert first.artifact_dir and Path(first.artifact_dir).is_dir()
    assert (Path(first.artifact_dir) / "ops.csv").is_file()

    def no_hash(_path):
        raise AssertionError("hash should come from the index")

    monkeypatch.setattr(cache, "trace_content_hash", no_hash)
    t = time.perf_counter()
    second = analyze_trace_cached(trace, top_k=10, cache_root=root)
    assert time.perf_counter() - t <= 1.0
    assert second == first
    other_k = analyze_trace_cached(trace, top_k=3, cache_root=root)
    assert len(other_k.top_ops) == 3 and other_k.artifact_dir != first.artifact_dir


def test_cache_key_follows_content_not_name(tmp_path):
    src = SYNTH / "kineto_overlap_flow_unknown_device.json"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_bytes(src.read_bytes())
    b.write_bytes(src.read_bytes())
    root = tmp_path / "cache"
    sa = analyze_trace_cached(a, cache_root=root)
    sb = analyze_trace_cached(b, cache_root=root)
    assert sa.artifact_dir == sb.artifact_dir and sb.trace == "b.json"
    doc = json.loads(src.read_text())
    doc["traceEvents"][-3]["dur"] = 20  # the flow-linked GEMM runs longer
    b.write_text(json.dumps(doc))
    sc = analyze_trace_cached(b, cache_root=root)  # same path, new mtime and size: re-hashed
    assert sc.artifact_dir != sa.artifact_dir and sc.timeline.total_us == 70.0


@needs_fixtures
def test_make_large_trace_keeps_linking_exact(tmp_path):
    src = FIXTURES / "h200_linear_gelu_layernorm_fp16.json"
    dst = tmp_path / "x3.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "make_large_trace.py"),
            str(src),
            str(dst),
            "--copies",
            "3",
        ],
        check=True,
        capture_output=True,
    )
    one, three = analyze_trace_file(src), analyze_trace_file(dst)
    assert three.timeline.gpu_events == 3 * one.timeline.gpu_events
    assert three.timeline.busy_us == pytest.approx(3 * one.timeline.busy_us, abs=0.3)
    assert three.linking.op_pct == one.linking.op_pct == 100.0
    assert [(r.name, r.calls) for r in three.top_ops] == [
        (r.name, 3 * r.calls) for r in one.top_ops
    ]
    gz = tmp_path / "x3.json.gz"
    gz.write_bytes(gzip.compress(dst.read_bytes()))
    assert analyze_trace_file(gz).timeline == three.timeline


@needs_fixtures
@pytest.mark.parametrize("name", ["h100_bert_small.json.gz", "h200_gpt2_generate_bf16.json.gz"])
def test_top_level_members_recovered_without_a_second_pass(name, monkeypatch):
    """Device properties after the events (re-serialised traces) or before them (libkineto
    output) come from the bytes kept while streaming, not from a second parse."""
    import loom_mcp.traces.jsonstream as jsonstream

    def boom(*_a):
        raise AssertionError("second pass taken")

    monkeypatch.setattr(jsonstream, "_top_level_slow", boom)
    s = analyze_trace_file(FIXTURES / name)
    assert s.device is not None and s.device.startswith("NVIDIA")
