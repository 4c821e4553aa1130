"""analyze_trace under attack, through the real MCP protocol (the pytest process is the server).

The attacks (tests/redteam/attack_traces.py) write their payloads at test time:

* nesting: 2 MB of `[` (grew the server to 20 GB);
* deep nesting: a valid trace nesting a million levels in one event (closed the
  connection);
* gzip bombs: 4-15 MB of gzip inflating to 4.3 GB (no cap);
* secrets: tokens inside op, kernel, API, device and block names (echoed back).

Each bomb must come back as a quick `[BAD_INPUT]` naming the limit it hit, without the server
process growing, and the server must then analyse a normal trace. No secret may appear anywhere
in what an agent can read: the tool result, the error text, the analysis resource, the
artifacts. Each limit (depth, token length, ratio, inflated size, wall time, memory) is also
driven on its own by lowering it through its environment variable.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import resource
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import orjson
import pytest
from mcp import Client

import loom_mcp.traces.jsonstream as jsonstream
from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.traces import analyze_trace_file, scrub_trace

REDTEAM = Path(__file__).parent / "redteam"
SYNTH = Path(__file__).parent / "fixtures" / "traces_synthetic"
NORMAL = SYNTH / "kineto_overlap_flow_unknown_device.json"

# Generous bounds for a loaded 2-core CI box; the measured values are printed (pytest -s).
MAX_SECONDS = 15.0
MAX_GROWTH_MIB = 300


def _attack(name: str):
    spec = importlib.util.spec_from_file_location(name, REDTEAM / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


hostile = _attack("attack_traces")


# --- measuring the server process ----------------------------------------------------------


def _reset_peak() -> bool:
    """Reset VmHWM (Linux: writing 5 to clear_refs), so the next read is this test's peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_kib() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _children_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# --- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attacks(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("attacks")
    files = {
        "nesting": hostile.write_nesting(d / "nesting.json"),
        "deep_arrays": hostile.write_deep_nesting(d / "deep_arrays.json", kind="arrays"),
        "deep_objects": hostile.write_deep_nesting(d / "deep_objects.json", kind="objects"),
    }
    for kind in ("events", "string", "whitespace", "rocprof"):
        files[f"gzip_{kind}"] = hostile.write_gzip_bomb(d / f"bomb_{kind}.json.gz", kind)
    return files


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "home"


def _server(home: Path, *roots: Path):
    allowed = ":".join(str(r) for r in roots)
    return build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": allowed}))


def _text(result) -> str:
    return "\n".join(getattr(c, "text", "") for c in result.content)


async def _normal_call_works(client, trace: Path) -> None:
    ok = await client.call_tool("analyze_trace", {"trace": str(trace)})
    assert ok.is_error is False, _text(ok)
    assert ok.structured_content["analysis"]["timeline"]["busy_us"] > 0


# --- bombs ----------------------------------------------------------------------------------

_RATIO_OR_TOKEN = ("LOOM_TRACE_MAX_RATIO", "LOOM_TRACE_MAX_TOKEN_BYTES")
BOMBS = {
    # attack -> the limits its error may name (whichever trips first)
    "nesting": ("LOOM_TRACE_MAX_DEPTH",),
    "deep_arrays": ("LOOM_TRACE_MAX_DEPTH",),
    "deep_objects": ("LOOM_TRACE_MAX_DEPTH",),
    "gzip_events": ("LOOM_TRACE_MAX_RATIO",),
    "gzip_string": _RATIO_OR_TOKEN,
    "gzip_whitespace": _RATIO_OR_TOKEN,
    "gzip_rocprof": _RATIO_OR_TOKEN,
}


@pytest.mark.anyio
@pytest.mark.parametrize("attack", list(BOMBS))
@pytest.mark.slow
async def test_bomb_is_refused_quickly_and_the_server_keeps_answering(attack, attacks, tmp_path,
                                                                      home):
    normal = shutil.copy(NORMAL, tmp_path / "normal.json")
    async with Client(_server(home, tmp_path, attacks[attack].parent)) as client:
        await _normal_call_works(client, Path(normal))  # warm: imports are not the attack's
        base_rss = _rss_kib()
        reset = _reset_peak()
        before = _peak_kib()
        t = time.perf_counter()
        result = await client.call_tool("analyze_trace", {"trace": str(attacks[attack])})
        elapsed = time.perf_counter() - t
        growth_mib = (_peak_kib() - (base_rss if reset else before)) / 1024
        text = _text(result)
        print(f"\n{attack}: {elapsed:.2f} s, server peak +{growth_mib:.0f} MiB "
              f"(VmHWM reset: {reset}), child peak so far {_children_peak_mib():.0f} MiB: {text}")
        assert result.is_error and "[BAD_INPUT]" in text, text
        assert any(limit in text for limit in BOMBS[attack]), text
        assert elapsed < MAX_SECONDS
        assert growth_mib < MAX_GROWTH_MIB
        # Same bytes again: refused again (errors are not cached as results), still quickly.
        again = await client.call_tool("analyze_trace", {"trace": str(attacks[attack])})
        assert again.is_error and "[BAD_INPUT]" in _text(again)
        await _normal_call_works(client, Path(normal))


def test_bombs_fail_fast_in_process_too(attacks):
    """The readers enforce depth, token and inflation limits themselves: the same errors come
    from analyze_trace_file in this process (the bench tool, tests), with no child to absorb
    the memory."""
    from loom_mcp.errors import LoomError
    from loom_mcp.traces import analyze_trace_file

    for attack, limits in BOMBS.items():
        before = _rss_kib()
        _reset_peak()
        t = time.perf_counter()
        with pytest.raises(LoomError) as exc:
            analyze_trace_file(attacks[attack])
        elapsed = time.perf_counter() - t
        growth_mib = (_peak_kib() - before) / 1024
        print(f"\nin-process {attack}: {elapsed:.2f} s, +{growth_mib:.0f} MiB")
        assert exc.value.code.value == "BAD_INPUT"
        assert any(limit in str(exc.value) for limit in limits)
        assert elapsed < MAX_SECONDS and growth_mib < MAX_GROWTH_MIB


# --- each limit on its own, lowered through its environment variable ------------------------


def _events_trace(path: Path, n: int) -> Path:
    """A valid Kineto trace of n kernels with distinct times (compresses like a real one)."""
    ev = [
        {"ph": "X", "cat": "kernel", "name": f"kernel_{i % 97}", "pid": 0, "tid": 7,
         "ts": 1000 + 3 * i, "dur": 2, "args": {"device": 0, "stream": 7, "correlation": i}}
        for i in range(n)
    ]
    path.write_bytes(orjson.dumps({"traceEvents": ev}, option=orjson.OPT_INDENT_2))
    return path


def _rocprof_trace(path: Path, n: int) -> Path:
    kd = [
        {"start_timestamp": 1_000 * i, "end_timestamp": 1_000 * i + 500,
         "dispatch_info": {"kernel_id": 1, "agent_id": {"handle": 2}, "queue_id": {"handle": 1}},
         "correlation_id": {"internal": i, "external": 0}}
        for i in range(n)
    ]
    doc = {"rocprofiler-sdk-tool": [{
        "metadata": {"pid": 1}, "agents": [{"type": 2, "id": {"handle": 2}, "name": "gfx942"}],
        "kernel_symbols": [{"kernel_id": 1, "kernel_name": "k"}], "strings": {},
        "buffer_records": {"kernel_dispatch": kd}}]}
    path.write_bytes(orjson.dumps(doc))
    return path


@pytest.mark.anyio
@pytest.mark.slow
async def test_each_limit_is_named(tmp_path, home, monkeypatch, attacks):
    normal = Path(shutil.copy(NORMAL, tmp_path / "normal.json"))
    gz = tmp_path / "big.json.gz"
    gz.write_bytes(gzip.compress(_events_trace(tmp_path / "big.json", 60_000).read_bytes()))
    rocprof = _rocprof_trace(tmp_path / "rocprof.json", 400_000)
    cases = [
        ({"LOOM_TRACE_MAX_INFLATED_BYTES": str(4 << 20)}, gz, "LOOM_TRACE_MAX_INFLATED_BYTES"),
        ({"LOOM_TRACE_MAX_RATIO": "2", "LOOM_TRACE_RATIO_GRACE_BYTES": str(1 << 20)}, gz,
         "LOOM_TRACE_MAX_RATIO"),
        ({"LOOM_TRACE_MAX_DEPTH": "2"}, normal, "LOOM_TRACE_MAX_DEPTH"),
        ({"LOOM_TRACE_MAX_TOKEN_BYTES": "8"}, normal, "LOOM_TRACE_MAX_TOKEN_BYTES"),
        # the 4.3 GB kernel name, with the ratio check out of the way
        ({"LOOM_TRACE_MAX_RATIO": "1e9"}, attacks["gzip_string"], "LOOM_TRACE_MAX_TOKEN_BYTES"),
        # the 4.3 GB of events, with only the inflated-size cap left (lowered to keep it short)
        ({"LOOM_TRACE_MAX_RATIO": "1e9", "LOOM_TRACE_MAX_INFLATED_BYTES": str(32 << 20)},
         attacks["gzip_events"], "LOOM_TRACE_MAX_INFLATED_BYTES"),
        ({"LOOM_TRACE_TIMEOUT_S": "0.05"}, normal, "LOOM_TRACE_TIMEOUT_S"),
        ({"LOOM_TRACE_MEMORY_BYTES": str(400 << 20)}, rocprof, "LOOM_TRACE_MEMORY_BYTES"),
    ]
    async with Client(_server(home, tmp_path, attacks["nesting"].parent)) as client:
        for env, trace, limit in cases:
            with monkeypatch.context() as m:
                for k, v in env.items():
                    m.setenv(k, v)
                t = time.perf_counter()
                result = await client.call_tool("analyze_trace", {"trace": str(trace)})
                text = _text(result)
                print(f"\n{limit}: {time.perf_counter() - t:.2f} s: {text}")
                assert result.is_error and "[BAD_INPUT]" in text and limit in text, text
        # With the defaults every one of these traces is fine.
        for trace in (gz, normal, rocprof):
            ok = await client.call_tool("analyze_trace", {"trace": str(trace)})
            assert ok.is_error is False, _text(ok)


# --- secrets --------------------------------------------------------------------------------


def _nsys_with_secrets(path: Path, s: dict[str, str]) -> Path:
    from tests.test_traces_synthetic import make_nsys

    make_nsys(path)
    db = sqlite3.connect(path)
    db.execute("UPDATE StringIds SET value = ? WHERE id = 10",
               (f"void cutlass::Kernel2<{s['github']}>(Params)",))
    db.execute("UPDATE StringIds SET value = ? WHERE id = 12",
               (f"void at::native::vectorized_elementwise_kernel<{s['aws']}>(int)",))
    db.execute("UPDATE TARGET_INFO_GPU SET name = ?",
               (f"NVIDIA H100 Authorization: Bearer {s['bearer']}",))
    db.commit()
    db.close()
    return path


def _fragments(s: dict[str, str]) -> list[str]:
    """Each secret, and a distinctive piece of its body: a cut token must not leak either."""
    out = []
    for v in s.values():
        body = v.split("_", 1)[-1].split("-", 1)[-1]
        out += [v, body[4:20]]
    return out


@pytest.mark.anyio
@pytest.mark.slow
async def test_no_secret_in_anything_analyze_trace_returns(tmp_path, home):
    s = hostile.secrets()
    named = tmp_path / f"trace_{s['aws']}.json"  # the file name carries one too
    kineto = hostile.write_kineto_with_secrets(named)
    rocprof = hostile.write_rocprof_with_secrets(tmp_path / "rocprof.json")
    malformed = hostile.write_malformed_with_secret(tmp_path / "malformed.json")
    nsys = _nsys_with_secrets(tmp_path / "nsys.sqlite", s)
    gz = tmp_path / "kineto.json.gz"
    gz.write_bytes(gzip.compress(kineto.read_bytes()))
    seen: list[str] = []
    cache = load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}).cache_dir / "traces"
    async with Client(_server(home, tmp_path)) as client:
        calls = [
            {"trace": str(kineto)},
            {"trace": str(gz), "top_k": 50},
            {"trace": str(rocprof)},
            {"trace": str(nsys)},
            {"trace": str(rocprof), "baseline": str(kineto)},
            {"trace": str(kineto), "baseline": str(nsys)},
        ]
        for args in calls:
            result = await client.call_tool("analyze_trace", args)
            assert result.is_error is False, _text(result)
            seen += [_text(result), json.dumps(result.structured_content)]
            aid = result.structured_content["analysis_id"]
            full = await client.read_resource(f"loom://traces/{aid}/analysis")
            seen.append(full.contents[0].text)
            artifacts = sorted((cache / aid).glob("*"))
            assert any(f.suffix == ".csv" for f in artifacts)
            seen += [f.read_text(errors="replace") for f in artifacts if f.suffix != ".png"]
        bad = await client.call_tool("analyze_trace", {"trace": str(malformed)})
        assert bad.is_error and "[BAD_INPUT]" in _text(bad)
        seen.append(_text(bad))
    blob = "\n".join(seen)
    assert "[REDACTED]" in blob  # the names were there, redacted
    assert "cutlass" in blob and "aten::mm" in blob  # and the rest of them kept
    for frag in _fragments(s):
        assert frag not in blob, frag


def test_artifacts_are_scrubbed_on_disk(tmp_path):
    """analyze_trace_file's artifacts (CSV, JSON, summary) hold no secret either."""
    from loom_mcp.traces import analyze_trace_file

    s = hostile.secrets()
    out = tmp_path / "out"
    summary = analyze_trace_file(hostile.write_kineto_with_secrets(tmp_path / "k.json"), out_dir=out)
    blob = summary.model_dump_json() + "".join(
        p.read_text(errors="replace") for p in out.iterdir() if p.suffix != ".png")
    assert "[REDACTED]" in blob
    for frag in _fragments(s):
        assert frag not in blob, frag


def test_attack_generators_run_as_scripts(tmp_path):
    import subprocess

    subprocess.run([sys.executable, str(REDTEAM / "attack_traces.py"), ".", "nesting", "deep", "secrets"],
                   cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "nesting.json").stat().st_size == hostile.NESTING_SIZE
    assert (tmp_path / "deep_objects.json").is_file() and (tmp_path / "secrets_kineto.json").is_file()


# --- secrets in metadata, and scrub_trace ---------------------------------------------------
# Traces carry secrets: the analysis never repeats metadata values, and scrub_trace removes
# environment dumps, tokens and keys (Kineto streamed, rocprofv3, nsys).
# SYNTH (above) is the same tests/fixtures/traces_synthetic directory these tests used.

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
