"""Traces carry secrets: the analysis never repeats metadata values, and scrub_trace removes
environment dumps, tokens and keys (Kineto streamed, rocprofv3, nsys)."""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import pytest

import loom_mcp.traces.jsonstream as jsonstream
from loom_mcp.traces import analyze_trace_file, scrub_trace

SYNTH = Path(__file__).resolve().parent / "fixtures" / "traces_synthetic"
FIXTURES = Path(__file__).parent / "fixtures" / "traces_real"


def fake_token() -> str:
    # Assembled at run time: no token-shaped literal is committed.
    return "hf_" + "Qx7" * 12


def fake_aws() -> str:
    return "AKIA" + "Z" * 16


def secret_trace(path: Path, *, where: str = "after") -> Path:
    """The synthetic overlap trace plus a harness metadata block holding an environment dump
    with a token, a second block before the events, and a token inside one event's args."""
    doc = json.loads((SYNTH / "kineto_overlap_flow_unknown_device.json").read_text())
    events = doc.pop("traceEvents")
    events[0]["args"]["Concrete Inputs"] = [f"HF_TOKEN={fake_token()}"]
    metadata = {
        "environment": {"HF_TOKEN": fake_token(), "AWS_ACCESS_KEY_ID": fake_aws(), "HOME": "/root"},
        "command": f"python serve.py --token={fake_token()}",
        "hostname": "gpu-node-0042.internal",
    }
    if where == "after":
        out = {
            "environment_dump": {"PATH": "/usr/bin"},
            **doc,
            "traceEvents": events,
            "metadata": metadata,
        }
    else:
        out = {"metadata": metadata, **doc, "traceEvents": events}
    path.write_text(json.dumps(out, indent=2))
    return path


SECRETS = [fake_token(), fake_aws(), "gpu-node-0042.internal"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_analysis_reports_metadata_but_never_its_values(tmp_path, where):
    p = secret_trace(tmp_path / "t.json", where=where)
    out = tmp_path / "out"
    s = analyze_trace_file(p, out_dir=out)
    m = s.metadata
    assert m.found and m.secret_like and "metadata" in m.blocks and m.keys >= 6
    assert s.timeline.busy_us == 34.0  # the extra blocks change nothing else
    blobs = [s.model_dump_json().encode()] + [(out / a).read_bytes() for a in s.artifacts]
    for secret in SECRETS:
        assert all(secret.encode() not in b for b in blobs), secret


def test_top_level_blocks_found_when_the_head_is_too_small(tmp_path, monkeypatch):
    """A metadata block larger than the kept head forces the second, streaming pass."""
    monkeypatch.setattr(jsonstream, "HEAD_BYTES", 64)
    calls = []
    slow = jsonstream._top_level_slow
    monkeypatch.setattr(jsonstream, "_top_level_slow", lambda *a: calls.append(a) or slow(*a))
    p = secret_trace(tmp_path / "t.json", where="before")
    s = analyze_trace_file(p)
    assert calls, "the second pass should have been taken"
    assert s.metadata.found and "metadata" in s.metadata.blocks
    assert s.device == "Imaginary GPU 9000"


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_scrub_kineto(tmp_path, suffix):
    src = secret_trace(tmp_path / "t.json")
    dst = tmp_path / f"clean{suffix}"
    rep = scrub_trace(src, dst)
    raw = gzip.decompress(dst.read_bytes()) if suffix.endswith(".gz") else dst.read_bytes()
    for secret in SECRETS:
        assert secret.encode() not in raw
    doc = json.loads(raw)
    assert "metadata" not in doc and "environment_dump" not in doc
    assert doc["deviceProperties"][0]["name"] == "Imaginary GPU 9000"
    assert sorted(rep.removed_blocks) == ["environment_dump", "metadata"]
    assert rep.removed_keys >= 7 and rep.redacted_values >= 1
    assert rep.events == len(doc["traceEvents"]) == 22
    before, after = analyze_trace_file(src), analyze_trace_file(dst)
    assert after.timeline == before.timeline and not after.metadata.found
    assert "[REDACTED]" in raw.decode()


def test_scrub_refuses_in_place(tmp_path):
    from loom_mcp.errors import LoomError

    src = secret_trace(tmp_path / "t.json")
    with pytest.raises(LoomError):
        scrub_trace(src, src)


def test_scrub_nsys(tmp_path):
    from tests.test_traces_synthetic import fake_token as nsys_token
    from tests.test_traces_synthetic import make_nsys

    src, dst = tmp_path / "r.sqlite", tmp_path / "clean.sqlite"
    make_nsys(src)
    db = sqlite3.connect(src)
    db.execute("INSERT INTO StringIds VALUES (99, ?)", (f"python run.py --token={nsys_token()}",))
    db.commit()
    db.close()
    rep = scrub_trace(src, dst)
    assert rep.removed_blocks == ["TARGET_INFO_SYSTEM_ENV"] and rep.redacted_values == 1
    assert nsys_token().encode() not in dst.read_bytes()
    s = analyze_trace_file(dst)
    assert not s.metadata.found and s.timeline.busy_us == 30.5


@pytest.mark.slow
def test_scrub_rocprofv3(tmp_path):
    src = FIXTURES / "rocprofv3_908_results.json.gz"
    dst = tmp_path / "clean.json.gz"
    rep = scrub_trace(src, dst)
    assert rep.removed_blocks == ["rocprofiler-sdk-tool[0].metadata"] and rep.events == 43915
    assert b"smci350-zts-gtu-c6-25" not in gzip.decompress(dst.read_bytes())
    s = analyze_trace_file(dst)
    assert s.timeline.gpu_events == 43915 and not s.metadata.found
