"""Server-side file access never follows a job's links (loom_mcp/sandbox/safefs.py), the call
sites that read or write job files use it, and a candidate that plants links under `profile`
(tests/redteam/attack_profile_symlink.py) cannot make the server touch a file outside."""

from __future__ import annotations

import gzip
import inspect
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import openat2, safefs

REDTEAM = Path(__file__).parent / "redteam"
VICTIM_TEXT = "victim: must never change\n"


@pytest.fixture(params=["openat2", "walk"])
def mode(request):
    """Every unit test runs with openat2 and with the O_NOFOLLOW component walk."""
    if request.param == "openat2" and not safefs.openat2_available():
        pytest.skip("openat2 is not available here")
    openat2._use_fallback(request.param == "walk")
    yield request.param
    openat2._use_fallback(False)


@pytest.fixture
def layout(tmp_path: Path):
    """A job directory, and a victim file outside it."""
    job = tmp_path / "job"
    (job / "sub").mkdir(parents=True)
    (job / "sub" / "out.txt").write_text("job output\n")
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return job, victim


def _code(exc: pytest.ExceptionInfo) -> ErrorCode:
    assert isinstance(exc.value, LoomError), exc.value
    return exc.value.code


# ------------------------------------------------------------------------------------ reads


def test_reads_a_regular_file(mode, layout):
    job, _ = layout
    assert safefs.read_bytes(job, "sub/out.txt", 100) == b"job output\n"
    assert safefs.read_text(job, "./sub/out.txt", 100) == "job output\n"
    with safefs.open_read(job, "sub/out.txt", max_bytes=100) as f:
        f.seek(4)
        assert f.read() == b"output\n"


def test_symlink_at_the_leaf_is_refused(mode, layout):
    job, victim = layout
    (job / "trace.json").symlink_to(victim)
    with pytest.raises(safefs.UnsafeFileError) as exc:
        safefs.read_bytes(job, "trace.json", 1 << 20)
    assert _code(exc) == ErrorCode.BAD_INPUT and "link" in exc.value.message
    (job / "rel.json").symlink_to("sub/out.txt")  # even a link that stays inside
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, "rel.json", 1 << 20)


def test_symlink_in_the_middle_is_refused(mode, layout):
    job, victim = layout
    (job / "via").symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, "via/victim.txt", 1 << 20)
    (job / "inner").symlink_to(job / "sub", target_is_directory=True)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, "inner/out.txt", 1 << 20)


@pytest.mark.parametrize("rel", ["../outside/victim.txt", "sub/../../outside/victim.txt"])
def test_dotdot_escape_is_refused(mode, layout, rel):
    job, _ = layout
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, rel, 1 << 20)


def test_absolute_and_nul_names_are_refused(mode, layout):
    job, victim = layout
    for rel in (str(victim), "sub/\0x"):
        with pytest.raises(safefs.UnsafeFileError):
            safefs.read_bytes(job, rel, 1 << 20)


def _in_thread(fn, timeout=10.0):
    """Run fn; a hang (a FIFO opened blocking) fails the test instead of stalling it."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the server blocked on the file"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_fifo_is_refused_without_blocking(mode, layout):
    job, _ = layout
    os.mkfifo(job / "trace.json")
    with pytest.raises(safefs.UnsafeFileError) as exc:
        _in_thread(lambda: safefs.read_bytes(job, "trace.json", 1 << 20))
    assert "not a regular file" in exc.value.message


def test_device_and_directory_are_refused(mode, layout, tmp_path):
    job, _ = layout
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, "sub", 1 << 20)
    # A device is reachable only through a link (a job cannot mknod one): refused as a link,
    # and opened directly it is still not a regular file.
    (job / "null").symlink_to("/dev/null")
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes(job, "null", 10)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_bytes("/dev", "null", 10)


def test_hard_link_is_refused_unless_allowed(mode, layout):
    job, victim = layout
    os.link(victim, job / "trace.json")
    with pytest.raises(safefs.UnsafeFileError) as exc:
        safefs.read_bytes(job, "trace.json", 1 << 20)
    assert "hard link" in exc.value.message
    assert safefs.read_bytes(job, "trace.json", 1 << 20, allow_hardlinks=True) == VICTIM_TEXT.encode()


def test_oversized_file_is_refused(mode, layout):
    job, _ = layout
    (job / "big").write_bytes(b"x" * 1000)
    assert len(safefs.read_bytes(job, "big", 1000)) == 1000
    with pytest.raises(safefs.UnsafeFileError) as exc:
        safefs.read_bytes(job, "big", 999)
    assert "more than" in exc.value.message


def test_a_file_growing_past_the_cap_while_read_is_refused(mode, layout):
    job, _ = layout
    (job / "grow").write_bytes(b"x" * 100)
    f = safefs.open_read(job, "grow", max_bytes=150)
    with open(job / "grow", "ab") as more:
        more.write(b"y" * 200)
    with f, pytest.raises(safefs.UnsafeFileError):
        f.read()


def test_missing_file_is_not_found(mode, layout):
    job, _ = layout
    with pytest.raises(LoomError) as exc:
        safefs.read_bytes(job, "nope.json", 10)
    assert _code(exc) == ErrorCode.NOT_FOUND


# ------------------------------------------------------------------------------------ writes


def test_atomic_write_over_a_symlink_leaves_its_target_untouched(mode, layout):
    job, victim = layout
    (job / "scrubbed.json").symlink_to(victim)
    safefs.write_text(job, "scrubbed.json", '{"traceEvents": []}')
    assert victim.read_text() == VICTIM_TEXT
    assert not (job / "scrubbed.json").is_symlink()
    assert (job / "scrubbed.json").read_text() == '{"traceEvents": []}'
    assert sorted(p.name for p in job.iterdir()) == ["scrubbed.json", "sub"]  # no temp left


def test_write_over_a_hard_link_leaves_the_other_name_untouched(mode, layout):
    job, victim = layout
    os.link(victim, job / "request.json")
    safefs.write_bytes(job, "request.json", b"{}")
    assert victim.read_text() == VICTIM_TEXT
    assert (job / "request.json").read_bytes() == b"{}"


def test_write_through_a_linked_directory_is_refused(mode, layout):
    job, victim = layout
    (job / "out").symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.write_text(job, "out/victim.txt", "pwned")
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_create_new_replaces_a_planted_name(mode, layout):
    job, victim = layout
    (job / "x.bin").symlink_to(victim)
    with safefs.create_new(job, "x.bin") as f:
        f.write(b"new")
    assert victim.read_text() == VICTIM_TEXT and (job / "x.bin").read_bytes() == b"new"


def test_copy_out_refuses_links_and_copies_regular_files(mode, layout, tmp_path):
    job, victim = layout
    dest_dir = tmp_path / "staging"
    dest_dir.mkdir()
    (job / "trace.json").symlink_to(victim)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.copy_out(job, "trace.json", dest_dir / "raw.json", max_bytes=1 << 20)
    assert safefs.copy_out(job, "sub/out.txt", dest_dir / "raw.json", max_bytes=1 << 20) == 11
    assert (dest_dir / "raw.json").read_text() == "job output\n"


# ------------------------------------------------------------------------------------ metadata


def test_exists_is_file_unlink_and_remove_tree_never_follow(mode, layout):
    job, victim = layout
    (job / "link").symlink_to(victim)
    (job / "dirlink").symlink_to(victim.parent, target_is_directory=True)
    assert safefs.exists(job, "link") and not safefs.is_file(job, "link")
    assert safefs.is_file(job, "sub/out.txt")
    assert not safefs.exists(job, "dirlink/victim.txt")  # not reached through the link
    assert safefs.unlink(job, "link") and victim.exists()
    with pytest.raises(safefs.UnsafeFileError):  # not through a linked directory
        safefs.unlink(job, "dirlink/victim.txt", missing_ok=False)
    assert not safefs.unlink(job, "dirlink/victim.txt") and victim.exists()
    safefs.remove_tree(job, "dirlink")
    assert not os.path.lexists(job / "dirlink") and victim.read_text() == VICTIM_TEXT
    (job / "sub" / "inner").symlink_to(victim.parent, target_is_directory=True)
    safefs.remove_tree(job, "sub")
    assert not (job / "sub").exists() and victim.read_text() == VICTIM_TEXT
    safefs.discard(job, "sub")  # gone already: never raises


def test_find_files_lists_regular_files_only(mode, layout):
    job, victim = layout
    out = job / "profile" / "run"
    out.mkdir(parents=True)
    (out / "small.json").write_text("{}")
    (out / "big.json").write_text("{" + " " * 100 + "}")
    (out / "link.json").symlink_to(victim)
    (job / "profile" / "elsewhere").symlink_to(victim.parent, target_is_directory=True)
    found = safefs.find_files(job, "profile", suffix=".json")
    assert [rel for rel, _ in found] == ["profile/run/big.json", "profile/run/small.json"]


# ------------------------------------------------------------------------------------ agent paths


def test_open_resolved_refuses_a_component_swapped_for_a_link(mode, tmp_path):
    real = tmp_path / "repo" / "cands"
    real.mkdir(parents=True)
    (real / "c.py").write_text("x = 1\n")
    resolved = (real / "c.py").resolve()
    assert safefs.read_resolved_text(resolved) == "x = 1\n"
    # After the roots check, the directory is swapped for a link to somewhere else.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "c.py").write_text("secret\n")
    real.rename(tmp_path / "repo" / "moved")
    real.symlink_to(other, target_is_directory=True)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_resolved_bytes(resolved)
    with pytest.raises(safefs.UnsafeFileError):
        safefs.read_resolved_bytes("relative/path.py")


def test_open_agent_file_checks_roots_and_names_the_resolved_path(mode, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "t.json").write_text("{}")
    (root / "alias.json").symlink_to(root / "t.json")
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (root / "escape.json").symlink_to(outside)
    with safefs.open_agent_file(root / "alias.json", [root], 100) as f:
        assert f.name == str((root / "t.json").resolve()) and f.read() == b"{}"
    with pytest.raises(LoomError) as exc:
        safefs.open_agent_file(root / "escape.json", [root], 100)
    assert _code(exc) == ErrorCode.NOT_ALLOWED
    with pytest.raises(safefs.UnsafeFileError):
        safefs.open_agent_file(root / "t.json", [root], 1)


# ------------------------------------------------------------------------------------ call sites


def test_request_file_is_not_written_through_a_planted_link(layout):
    from loom_mcp.sandbox.job import JobSpec
    from loom_mcp.sandbox.runner import _prepare

    job, victim = layout
    (job / "request.json").symlink_to(victim)
    spec = JobSpec(argv=["true"], job_dir=job, request={"hello": 1})
    extra = len(inspect.signature(_prepare).parameters) - 2  # e.g. memory_bytes, unused here
    _prepare(spec, {"limit_by": "none"}, *([0] * extra))
    assert victim.read_text() == VICTIM_TEXT
    assert json.loads((job / "request.json").read_text()) == {"hello": 1}


def test_metrics_file_link_is_refused(layout):
    from pathlib import PurePosixPath

    from loom_mcp.bench.command import _read_metrics
    from loom_mcp.bench.metrics import OutputError

    job, victim = layout
    assert _read_metrics(job, PurePosixPath("absent.json")) is None
    (job / "m.json").symlink_to(victim)
    with pytest.raises(OutputError):
        _read_metrics(job, PurePosixPath("m.json"))
    os.mkfifo(job / "f.json")
    with pytest.raises(OutputError):
        _in_thread(lambda: _read_metrics(job, PurePosixPath("f.json")))


def test_git_link_file_that_is_a_fifo_or_link_does_not_hang_or_follow(tmp_path):
    from loom_mcp import gitops

    d = tmp_path / "wt"
    d.mkdir()
    os.mkfifo(d / ".git")
    assert _in_thread(lambda: gitops.worktrees._points_into(None, d)) is None  # type: ignore[arg-type]
    os.unlink(d / ".git")
    target = tmp_path / "gitfile"
    target.write_text("gitdir: /somewhere/.git/worktrees/x\n")
    (d / ".git").symlink_to(target)
    assert gitops.worktrees._points_into(None, d) is None  # type: ignore[arg-type]


KINETO = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "ts": 0, "dur": 5.0, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "cpu_op", "name": "aten::rsqrt", "ts": 10, "dur": 3.0, "pid": 1, "tid": 1},
]}


def _profile_with(tmp_path: Path, monkeypatch, plant):
    """profile_workload with the worker replaced: it writes a valid trace, then `plant` does
    what a hostile job could have done to its directory before the server looks."""
    import anyio

    from loom_mcp.config import load_config
    from loom_mcp.profiling import runner
    from loom_mcp.store import ArtifactStore, Ledger

    home = tmp_path / "home"
    home.mkdir()
    ledger = Ledger(home / "ledger.sqlite3")
    artifacts = ArtifactStore(home / "artifacts", ledger)

    async def fake_torch_trace(job_dir: Path, **_kw) -> str:
        (job_dir / "trace.json").write_text(json.dumps(KINETO))
        plant(job_dir)
        return "trace.json"

    monkeypatch.setattr(runner, "_torch_trace", fake_torch_trace)

    async def go():
        return await runner.profile_workload(
            load_config(home), ledger, artifacts,
            profiler="torch", task=tmp_path / "task.py", candidate=None, shape=None, script=None,
            args=[], command=None, warmup=0, active=1, device="cpu",
            campaign_id=None, progress=None)

    return anyio.run(go), home


def _artifact_bytes(home: Path) -> bytes:
    out = b""
    for p in (home / "artifacts").rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            out += gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    return out


def test_profile_runner_never_writes_through_a_planted_scrubbed_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)

    def plant(job_dir: Path) -> None:
        for name in ("scrubbed.json", "scrubbed.json.gz", "raw.json"):
            (job_dir / name).symlink_to(victim)

    result, _ = _profile_with(tmp_path, monkeypatch, plant)
    assert victim.read_text() == VICTIM_TEXT
    assert result.trace_bytes > 0 and {o.name for o in result.top_ops} == {"aten::mul", "aten::rsqrt"}
    assert not list((tmp_path / "home" / "cache" / "staging").iterdir())  # staging cleaned up


@pytest.mark.parametrize("how", ["symlink", "hardlink", "fifo"])
def test_profile_runner_refuses_a_trace_that_is_not_the_jobs_own_file(tmp_path, monkeypatch, how):
    secret = tmp_path / "secret.json"
    marker = "SECRET-" + os.urandom(6).hex()
    secret.write_text(json.dumps({**KINETO, "displayTimeUnit": marker}))
    before = secret.read_bytes()

    def plant(job_dir: Path) -> None:
        (job_dir / "trace.json").unlink()
        if how == "symlink":
            (job_dir / "trace.json").symlink_to(secret)
        elif how == "hardlink":
            os.link(secret, job_dir / "trace.json")
        else:
            os.mkfifo(job_dir / "trace.json")

    with pytest.raises(LoomError) as exc:
        _in_thread(lambda: _profile_with(tmp_path, monkeypatch, plant), timeout=60)
    assert exc.value.code == ErrorCode.BAD_INPUT, exc.value
    assert secret.read_bytes() == before
    assert marker.encode() not in _artifact_bytes(tmp_path / "home")


# ------------------------------------------------------------------------------------ through MCP


def _attack_workspace(tmp_path: Path, mode: str, victim_text: str) -> tuple[Path, Path, Path]:
    """base/home (LOOM_HOME), base/work (the only allowed root), base/victim.txt (outside)."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REDTEAM / "task_rmsnorm.py", work / "task_rmsnorm.py")
    victim = tmp_path / "victim.txt"
    victim.write_text(victim_text)
    source = (REDTEAM / "attack_profile_symlink.py").read_text()
    source = source.replace("VICTIM = None", f"VICTIM = {str(victim)!r}", 1)
    candidate = work / f"attack_profile_symlink_{mode}.py"
    candidate.write_text(source)
    return work, candidate, victim


@pytest.mark.anyio
@pytest.mark.parametrize("attack", ["scrubbed", "tracelink", "fifo"])
@pytest.mark.slow
async def test_profile_attack_through_mcp(tmp_path, attack):
    pytest.importorskip("torch")
    from mcp import Client

    from loom_mcp.config import load_config
    from loom_mcp.server import build_server

    marker = "SECRET-" + os.urandom(6).hex()
    victim_text = json.dumps({**KINETO, "displayTimeUnit": marker}) if attack == "tracelink" \
        else VICTIM_TEXT
    work, candidate, victim = _attack_workspace(tmp_path, attack, victim_text)
    home = tmp_path / "home"
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(work)}))
    async with Client(server) as client:
        result = await client.call_tool("profile", {
            "task": str(work / "task_rmsnorm.py"), "candidate": str(candidate),
            "warmup": 1, "active": 1})
    text = result.content[0].text if result.content else ""
    assert victim.read_text() == victim_text
    if attack == "scrubbed":
        # The links are ignored: the server scrubs a private copy, never the job's names.
        assert not result.is_error, text
        assert result.structured_content["trace_bytes"] > 0
        # (Whether the links could be planted depends on the sandbox; the unit tests above plant
        # them directly.)
    else:
        # A trace that is a link or a FIFO is never read: a coded error (or the sandbox stopped
        # the worker itself from planting it).
        assert result.is_error, text
        assert re.search(r"\[(BAD_INPUT|WORKER_CRASHED)\]", text), text
    assert "[INTERNAL]" not in text
    assert marker.encode() not in _artifact_bytes(home)
