"""How validation hands tensors between its processes, sizes a job before running it, and tells
the candidate's own threads from the ones torch starts.

The bundle format is exercised directly; everything else goes through run_validation over the
real MCP protocol with real sandboxed workers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.worker import handoff, reference
from loom_mcp.worker.harness import load_module, wait_for_go
from loom_mcp.worker.protocol import publish_go

# ---------------------------------------------------------------- the bundle format


def test_a_bundle_round_trips_values_and_splits_big_tensors(tmp_path: Path) -> None:
    big = torch.randn(1000, 33)  # 132 000 bytes: five files of 32 KiB and one of the rest
    value = [{"seed": 7, "inputs": [big, torch.arange(5), 3, 0.5, None, "x"],
              "init_inputs": (4, torch.float16), "state_dict": {"w": torch.ones(2, 2).bfloat16()}},
             [torch.empty(0, 3), torch.randn(2, 3)[:, 1]]]
    handoff.write_bundle(tmp_path / "b", value, chunk_bytes=32 << 10)
    files = sorted(p.name for p in (tmp_path / "b").glob("t0.*.bin"))
    assert len(files) == 5 and all((tmp_path / "b" / f).stat().st_size <= 32 << 10 for f in files)
    back = handoff.read_bundle(tmp_path / "b")
    assert torch.equal(back[0]["inputs"][0], big)
    assert back[0]["inputs"][1:] == [back[0]["inputs"][1], 3, 0.5, None, "x"]
    assert torch.equal(back[0]["inputs"][1], torch.arange(5))
    assert back[0]["init_inputs"] == (4, torch.float16)
    assert back[0]["state_dict"]["w"].dtype == torch.bfloat16
    assert back[1][0].shape == (0, 3) and torch.equal(back[1][1], value[1][1])


def test_a_mapped_tensor_is_copy_on_write(tmp_path: Path) -> None:
    """The candidate may write into its inputs (the input-mutation check sees it); the file,
    which is the reference's, never changes."""
    x = torch.arange(handoff.MAP_BYTES // 4, dtype=torch.float32)
    handoff.write_bundle(tmp_path / "b", [x])
    mapped = handoff.read_bundle(tmp_path / "b")[0]
    assert torch.equal(mapped, x)
    mapped.zero_()
    assert torch.equal(handoff.read_bundle(tmp_path / "b")[0], x)


@pytest.mark.parametrize("attack", ["symlink", "short", "dtype", "name", "fifo", "repeated"])
def test_a_forged_bundle_is_refused(tmp_path: Path, attack: str) -> None:
    """The reference reads what the candidate wrote: nothing in it is trusted."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 64)
    bundle = tmp_path / "b"
    handoff.write_bundle(bundle, [torch.zeros(16)])
    manifest = (bundle / "manifest.json").read_text()
    if attack == "symlink":
        (bundle / "t0.0.bin").unlink()
        (bundle / "t0.0.bin").symlink_to(secret)
    elif attack == "short":
        (bundle / "t0.0.bin").write_bytes(b"\0" * 8)
    elif attack == "dtype":
        (bundle / "manifest.json").write_text(manifest.replace('"float32"', '"Tensor"'))
    elif attack == "fifo":  # opening it for reading would wait for a writer forever
        (bundle / "t0.0.bin").unlink()
        os.mkfifo(bundle / "t0.0.bin")
    elif attack == "repeated":  # one sparse file named three times: three times the memory
        (bundle / "t0.0.bin").write_bytes(b"\0" * 32)
        (bundle / "manifest.json").write_text(
            manifest.replace('"chunks": ["t0.0.bin"]', '"chunks": ["t0.0.bin", "t0.0.bin"]'))
    else:
        (bundle / "manifest.json").write_text(manifest.replace('"t0.0.bin"', '"../secret.bin"'))
    began = time.monotonic()
    with pytest.raises((OSError, ValueError)):
        handoff.read_bundle(bundle)
    assert time.monotonic() - began < 5


def test_a_case_bigger_than_expected_is_refused_before_it_is_read(tmp_path: Path) -> None:
    handoff.write_case(tmp_path, 0, [torch.zeros(1024)])
    assert handoff.read_case(tmp_path, 0, max_bytes=4096)[0].numel() == 1024
    with pytest.raises(ValueError, match="more than the 4095 expected"):
        handoff.read_case(tmp_path, 0, max_bytes=4095)


def _host_lender(region: torch.Tensor, placed: list[int]):
    """A lender over a host tensor standing in for a device region: the manifest logic is the
    same whatever memory the region is (the device path itself: tests/test_lending_gpu.py)."""
    def lend(tensor: torch.Tensor) -> dict[str, Any]:
        at = sum(placed)
        nbytes = tensor.numel() * tensor.element_size()
        region[at:at + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        placed.append((nbytes + 255) // 256 * 256)
        return {"handle": "ab" * 64, "size": region.numel(), "offset": at}
    return lend


def test_a_lent_tensor_is_opened_in_place_only_where_lending_is_accepted(tmp_path: Path) -> None:
    region = torch.zeros(4096, dtype=torch.uint8)
    x, w = torch.randn(8, 4), torch.arange(6, dtype=torch.int64)
    handoff.write_case(tmp_path, 0, {"inputs": [x], "state_dict": {"w": w}, "seed": 3},
                       lend=_host_lender(region, []))
    assert not list((tmp_path / "c0").glob("*.bin"))  # nothing went to files
    opened: list[tuple[str, int]] = []

    def open_lent(handle: str, size: int) -> torch.Tensor:
        opened.append((handle, size))
        return region

    case = handoff.read_case(tmp_path, 0, open_lent=open_lent)
    assert torch.equal(case["inputs"][0], x) and torch.equal(case["state_dict"]["w"], w)
    case["inputs"][0].zero_()  # in place: the region's bytes, no copy
    assert not region[:128].any()
    assert opened == [("ab" * 64, 4096)] * 2
    # The trusted side never opens memory a candidate names.
    with pytest.raises(ValueError, match="lent in device memory"):
        handoff.read_case(tmp_path, 0)


@pytest.mark.parametrize("attack", ["past_end", "negative", "size_mismatch", "not_int"])
def test_a_lent_tensor_outside_its_region_is_refused(tmp_path: Path, attack: str) -> None:
    region = torch.zeros(1024, dtype=torch.uint8)
    handoff.write_case(tmp_path, 0, [torch.ones(64)], lend=_host_lender(region, []))
    manifest = tmp_path / "c0" / "manifest.json"
    text = manifest.read_text()
    forged = {
        "past_end": text.replace('"offset": 0', '"offset": 900'),
        "negative": text.replace('"offset": 0', '"offset": -256'),
        "size_mismatch": text.replace('"nbytes": 256', '"nbytes": 128'),
        "not_int": text.replace('"offset": 0', '"offset": "0"'),
    }[attack]
    assert forged != text
    manifest.write_text(forged)
    with pytest.raises(ValueError):
        handoff.read_case(tmp_path, 0, open_lent=lambda handle, size: region)


def test_outputs_in_slots_resolve_to_the_trusted_copies_only(tmp_path: Path) -> None:
    """A candidate's outputs may name the case's output slots; the trusted side reads them as
    its own copies of the slots, and refuses slot names when it lent none or past the count."""
    handoff.write_case(tmp_path, 0, handoff.slot_refs(2))
    assert handoff.slot_case(tmp_path, 0)
    copies = [torch.ones(3), torch.zeros(2)]
    got = handoff.read_case(tmp_path, 0, slots=copies)
    assert got[0] is copies[0] and got[1] is copies[1]
    with pytest.raises(ValueError, match="output slot"):
        handoff.read_case(tmp_path, 0)
    with pytest.raises(ValueError, match="output slot"):
        handoff.read_case(tmp_path, 0, slots=copies[:1])
    handoff.write_case(tmp_path, 1, [torch.ones(3)])
    assert not handoff.slot_case(tmp_path, 1) and not handoff.slot_case(tmp_path, 7)


def test_the_candidates_directory_cannot_make_the_reference_fail(tmp_path: Path) -> None:
    """Whether the candidate is done with a case is asked of its directory: an error there (a
    mode that refuses us, a name too long) means not yet, never the reference's failure."""
    assert reference._consumed({"outputs_dir": str(tmp_path / ("x" * 300))}, 0) is False
    handoff.write_case(tmp_path / "out", 0, [torch.zeros(2)])
    assert reference._consumed({"outputs_dir": str(tmp_path / "out")}, 0) is True


def test_the_workers_exit_flushes_the_streams_it_started_with(tmp_path: Path) -> None:
    """A candidate that swaps sys.stdout for an object of its own gets no call at exit (it could
    rewrite its saved outputs there, after they were published)."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    script = (
        "import sys\n"
        "from loom_mcp.worker import protocol\n"
        "class Sneaky:\n"
        "    def write(self, s): return len(s)\n"
        f"    def flush(self): open({str(marker)!r}, 'w').write('late')\n"
        "sys.stdout = Sneaky()\n"
        "protocol.exit_now()\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert not marker.exists()


# ---------------------------------------------------------------- through run_validation

BIG_TASK = '''
import torch

batch_size = 256


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(batch_size, 1024, 1024)]


def get_init_inputs():
    return []
'''

SMALL_TASK = BIG_TASK.replace("batch_size = 256", "batch_size = 1")  # 4 MiB of inputs

HONEST = '''
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + x
'''

OWN_THREAD = '''
import threading

import torch

_stop = threading.Event()


class ModelNew(torch.nn.Module):
    def forward(self, x):
        threading.Thread(target=_poll, name="compile_worker_0", daemon=True).start()
        return x + x


def _poll():
    while not _stop.wait(0.01):
        pass
'''


def _server(root: Path, **settings: int):
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "loom.toml").write_text("".join(f"{k} = {v}\n" for k, v in settings.items()))
    return build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(root)}))


async def _validate(server, task: Path, candidate: Path, **extra):
    async with Client(server) as client:
        return await client.call_tool("run_validation", {
            "task": str(task), "candidate": str(candidate), **extra})


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_job_too_big_for_the_memory_limit_is_refused_before_it_runs(tmp_path: Path) -> None:
    """1 GiB of inputs per case, five cases kept by the reference, against a 3 GiB job limit:
    sized on the meta device, refused before any input is made, with what to do."""
    (tmp_path / "task.py").write_text(BIG_TASK)
    (tmp_path / "cand.py").write_text(HONEST)
    server = _server(tmp_path, job_memory_bytes=3 << 30)
    began = time.monotonic()
    result = await _validate(server, tmp_path / "task.py", tmp_path / "cand.py")
    text = result.content[0].text
    assert result.is_error, text
    assert "[RESOURCE_LIMIT]" in text, text
    assert "1 GiB of inputs" in text and "3 GiB" in text and "task_globals" in text, text
    assert "reference failed" not in text
    assert time.monotonic() - began < 120


def test_inputs_on_disk_are_every_case_within_the_window_else_the_two_biggest() -> None:
    from loom_mcp.worker.fits import inputs_on_disk

    assert inputs_on_disk([1, 2, 3], window_bytes=10) == 6
    assert inputs_on_disk([8, 8, 8, 8, 8], window_bytes=4) == 16
    assert inputs_on_disk([1, 1, 1, 1, 1], window_bytes=3) == 3  # a window's worth, not just two


@pytest.mark.slow
@pytest.mark.anyio
async def test_cases_whose_inputs_together_pass_the_disk_quota_still_validate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five cases of 4 MiB inputs against a 12 MiB job disk quota: written two at a time (each
    deleted once the candidate is done with it), they validate; all at once they could not."""
    from loom_mcp.validate import runner

    monkeypatch.setattr(runner, "INPUT_WINDOW_BYTES", 1)
    reduce_task = SMALL_TASK.replace("return x * 2", "return x.sum(-1)")
    (tmp_path / "task.py").write_text(reduce_task)
    (tmp_path / "cand.py").write_text(HONEST.replace("return x + x", "return x.sum(-1)"))
    server = _server(tmp_path, job_disk_bytes=12 << 20)
    result = await _validate(server, tmp_path / "task.py", tmp_path / "cand.py", seeds=5)
    assert result.is_error is False, result.content
    report = result.structured_content
    assert report["passed"] is True and report["cases_total"] == 5, report


@pytest.mark.slow
@pytest.mark.anyio
async def test_tensors_larger_than_the_per_file_limit_pass_validation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 MiB inputs and outputs under a 1 MiB per-file limit (RLIMIT_FSIZE) in both workers: a
    file that size would kill the writer with SIGXFSZ; the tensors travel in pieces."""
    from loom_mcp.validate import runner

    monkeypatch.setattr(runner, "JOB_FILE_BYTES", 1 << 20)
    (tmp_path / "task.py").write_text(SMALL_TASK)
    (tmp_path / "cand.py").write_text(HONEST)
    result = await _validate(_server(tmp_path), tmp_path / "task.py", tmp_path / "cand.py",
                             seeds=5)
    assert result.is_error is False, result.content
    report = result.structured_content
    assert report["passed"] is True, report
    assert report["cases_total"] == 5


# Returns zeros, and in each later case's first call writes the right values into the files of
# the case before, which were published already (reached past the static checks on purpose:
# the runtime must hold on its own).
REWRITES_EARLIER_OUTPUTS = """
import posix

import torch

_opn = getattr(posix, "op" + "en")
_calls = [0]
_good = {}


class ModelNew(torch.nn.Module):
    def forward(self, x):
        index, first = _calls[0] // 2, _calls[0] % 2 == 0
        _calls[0] += 1
        if first and index > 0:
            try:
                fd = _opn("outputs/c%d/t0.0.bin" % (index - 1), posix.O_WRONLY)
                posix.write(fd, memoryview(_good.pop(index - 1).numpy()).cast("B"))
                posix.close(fd)
            except OSError:
                pass
        _good[index] = (x * 2).contiguous()
        return torch.zeros_like(x)
"""


@pytest.mark.slow
@pytest.mark.anyio
async def test_outputs_rewritten_after_they_were_published_do_not_count(tmp_path: Path) -> None:
    """Each case's outputs leave the candidate's directory once published: rewriting them
    during a later case changes nothing, and the zeros it returned are what is compared."""
    (tmp_path / "task.py").write_text(SMALL_TASK.replace("1024, 1024", "4, 64"))
    (tmp_path / "cand.py").write_text(REWRITES_EARLIER_OUTPUTS)
    result = await _validate(_server(tmp_path), tmp_path / "task.py", tmp_path / "cand.py")
    report = result.structured_content
    assert report["passed"] is False, report
    assert report["cases_failed"] == report["cases_total"] == 5
    assert "validation.mismatch" in {f["check"] for f in report["findings"]}


# A mode entered in forward and never left: every tensor operation of the harness after it
# (copying the outputs out, comparing them) would run through the candidate's code.
LEAVES_A_MODE = """
import torch
from torch.overrides import TorchFunctionMode


class _Answer(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class ModelNew(torch.nn.Module):
    def forward(self, x):
        _Answer().__enter__()
        return torch.zeros_like(x)
"""

# Returns zeros, keeps them, and in the determinism rerun writes the right values into the
# zeros it returned first and returns the right values too: both calls then "agree".
FIXES_ITS_FIRST_ANSWER_LATER = """
import torch

_kept = []


class ModelNew(torch.nn.Module):
    def forward(self, x):
        if _kept:
            first = _kept.pop()
            first.copy_(x * 2)
            return x * 2
        out = torch.zeros_like(x)
        _kept.append(out)
        return out
"""


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("source, check", [(LEAVES_A_MODE, "validation.mode"),
                                           (FIXES_ITS_FIRST_ANSWER_LATER, "validation.mismatch")])
async def test_what_forward_returned_is_what_is_compared(tmp_path: Path, source: str, check: str) -> None:
    """The harness publishes its own copy of what forward returned, taken at return, and refuses
    to go on with a torch mode the candidate left active."""
    (tmp_path / "task.py").write_text(SMALL_TASK.replace("1024, 1024", "4, 64"))
    (tmp_path / "cand.py").write_text(source)
    result = await _validate(_server(tmp_path), tmp_path / "task.py", tmp_path / "cand.py")
    report = result.structured_content
    assert report["passed"] is False, report
    assert report["cases_failed"] == report["cases_total"] == 5, report
    text = str(report)
    if check == "validation.mode":
        assert "torch function or dispatch mode" in text, text
    else:
        assert check in {f["check"] for f in report["findings"]}, report


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_reference_killed_by_sigkill_is_reported_as_out_of_memory(tmp_path: Path) -> None:
    """What the kernel's OOM killer does to the reference (a SIGKILL nobody on our side sent) is
    a resource limit, never 'the task's reference failed' nor the candidate's fault."""
    task = SMALL_TASK.replace("        return x * 2", "        import os, signal\n"
                              "        os.kill(os.getpid(), signal.SIGKILL)")
    (tmp_path / "task.py").write_text(task)
    (tmp_path / "cand.py").write_text(HONEST)
    result = await _validate(_server(tmp_path), tmp_path / "task.py", tmp_path / "cand.py")
    text = result.content[0].text
    assert result.is_error and "[RESOURCE_LIMIT]" in text, text
    assert "ran out of memory" in text and "reference failed" not in text


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_thread_the_candidate_leaves_running_is_named_with_where_it_started(
        tmp_path: Path) -> None:
    """Named like a compiler's pool thread, started from the candidate's forward: attributed by
    where it was started, not by its name. (torch.compile's own threads pass: test_guard.)"""
    (tmp_path / "task.py").write_text(SMALL_TASK.replace("1024, 1024", "8, 64"))
    (tmp_path / "cand.py").write_text(OWN_THREAD)
    result = await _validate(_server(tmp_path), tmp_path / "task.py", tmp_path / "cand.py")
    assert result.is_error is False, result.content
    report = result.structured_content
    threads = [f for f in report["findings"] if f["check"] == "validation.threads"]
    assert report["passed"] is False and threads, report["findings"]
    message = threads[0]["message"]
    assert "'compile_worker_0' started at cand.py:11 in forward" in message, message
    assert "running cand.py:" in message and "_poll" in message, message
    assert "join" in message, message


# ---------------------------------------------------------------- whose threads

THREADS_CANDIDATE = '''
import concurrent.futures
import threading

import tqdm

stop = threading.Event()


def spin():
    while not stop.wait(0.01):
        pass


def library_thread():
    tqdm.tqdm(total=1, disable=False, file=open("/dev/null", "w"))  # tqdm's monitor thread
    return [t for t in threading.enumerate() if t.name == "tqdm_monitor"]


def named_like_a_library():
    threading.Thread(target=spin, name="tqdm_monitor", daemon=True).start()


def pool():
    concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch_pool").submit(stop.wait)


def from_elsewhere():
    """A module written where no installed code lives (its job directory, a compile cache)."""
    import importlib.util
    import tempfile

    path = tempfile.mkdtemp() + "/helper.py"
    with open(path, "w") as f:
        f.write("import threading" + chr(10) + "def go(target):" + chr(10) + "    threading.Thread("
                "target=target, name='pool_worker', daemon=True).start()" + chr(10))
    spec = importlib.util.spec_from_file_location("helper", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    helper.go(stop.wait)


def original_start():
    start = threading.Thread.start.__closure__
    original = next(c.cell_contents for c in start if getattr(c.cell_contents, "__name__", "") == "start")
    original(threading.Thread(target=stop.wait, name="unwrapped", daemon=True))
'''

THREADS_DRIVER = '''
import json, sys
sys.path.insert(0, {repo!r})
from loom_mcp.worker import harness
before = harness.running_thread_ids()
left_running = harness.track_threads({cand!r})
cand = harness.load_module({cand!r}, "cand")
seen = {{}}
for step in ("library_thread", "named_like_a_library", "pool", "from_elsewhere", "original_start"):
    now = harness.running_thread_ids()
    returned = getattr(cand, step)()
    seen[step] = left_running(now)
    if step == "library_thread":
        seen["monitor_started"] = bool(returned)
print(json.dumps(seen), flush=True)
cand.stop.set()
'''


def test_threads_are_attributed_by_who_started_them_not_by_name(tmp_path: Path) -> None:
    """A library's thread (tqdm's monitor, started from tqdm's code) is allowed; the candidate's
    own thread named like it, its own pool, one started from a module it wrote elsewhere, and
    one started around the wrapper are not."""
    import json
    import subprocess
    import sys

    cand = tmp_path / "cand.py"
    cand.write_text(THREADS_CANDIDATE)
    driver = THREADS_DRIVER.format(repo=str(Path(__file__).resolve().parents[1]), cand=str(cand))
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["monitor_started"] and seen["library_thread"] == [], seen
    [named] = seen["named_like_a_library"]
    assert named["name"] == "tqdm_monitor" and named["started_at"].startswith("cand.py:")
    assert "named_like_a_library" in named["started_at"] and "spin" in named["running"]
    [pooled] = seen["pool"]
    assert pooled["name"].startswith("torch_pool") and "in pool" in pooled["started_at"]
    [elsewhere] = seen["from_elsewhere"]
    assert elsewhere["started_at"] == "helper.py:3 in go", elsewhere
    [unwrapped] = seen["original_start"]
    assert unwrapped["started_at"] == "outside threading.Thread.start", unwrapped


# ---------------------------------------------------------------- the reference worker, called directly
# The trusted reference worker's validation step, called directly (a plain function, in a thread,
# with this test playing the candidate and the server through real signed go-files).
# On a GPU it computes reference outputs while the candidate runs and compares afterwards; on a
# CPU it computes each one after the candidate. Both orders must give the same verdicts.

TOKEN = "test-signing-token"

REPO = Path(__file__).resolve().parents[1]
TASK = str(REPO / "kernels" / "rmsnorm" / "task.py")
SHAPES = ["decode_t1_h4096", "decode_t8_h4000_fp32"]


def _outputs(cases_dir: Path, corrupt_index: int | None) -> list[list[torch.Tensor]]:
    """What an honest candidate returns (the task's own Model), one case made wrong."""
    task = load_module(TASK, "rmsnorm_task_for_test")
    outputs = []
    for index, case in enumerate(handoff.read_cases(cases_dir, wait_s=60)):
        model = task.Model(*case["init_inputs"])
        model.load_state_dict(case["state_dict"])
        with torch.no_grad():
            out = model(*case["inputs"])
        if index == corrupt_index:
            out = out * 1.5
        outputs.append([out])
    return outputs


def _start_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: dict):
    """The worker's `validate` on a thread: (thread, its result box, (cases, outputs, cand.go,
    ref.go) paths)."""
    monkeypatch.setenv("LOOM_GO_SIGNER", TOKEN)
    paths = (tmp_path / "cases", tmp_path / "outputs", tmp_path / "cand.go", tmp_path / "ref.go")
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(result=reference.validate({
        **request, "cases_dir": str(paths[0]), "outputs_dir": str(paths[1]),
        "cand_go_file": str(paths[2]), "go_file": str(paths[3])})))
    worker.start()
    return worker, box, paths


def _validate_as_the_candidate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: dict,
                               candidate: Callable[[Path], list]) -> dict[str, Any]:
    """Run the worker's `validate`; once it says the inputs are written, save what `candidate`
    returns for them and tell the worker the candidate has exited."""
    worker, box, (cases_dir, outputs_dir, cand_go, ref_go) = _start_reference(tmp_path, monkeypatch, request)
    deadline = time.monotonic() + 120
    while not cand_go.exists() and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cand_go.exists(), "the worker never signalled that the inputs are written"
    assert not ref_go.exists()
    handoff.write_cases(outputs_dir, candidate(cases_dir))
    publish_go(str(ref_go), {}, TOKEN)
    worker.join(120)
    return box["result"]


@pytest.mark.parametrize("ahead_host_bytes", [None, 1 << 30, 1])
def test_compare_gives_the_same_verdicts_whether_references_are_computed_ahead_or_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead_host_bytes: int | None) -> None:
    monkeypatch.setenv("LOOM_NONCE", "12345")
    request = {"task": TASK, "seeds": 2, "shapes": SHAPES, "device": "cpu",
               "tolerances": {"bfloat16": {"atol": 1e-2, "rtol": 1e-2},
                              "float32": {"atol": 1e-4, "rtol": 1e-4}}}
    if ahead_host_bytes is not None:
        request["ahead_host_bytes"] = ahead_host_bytes  # 1 byte: only the first case ahead
    result = _validate_as_the_candidate(tmp_path, monkeypatch, request,
                                        lambda cases_dir: _outputs(cases_dir, corrupt_index=1))
    assert [c["shape"]["name"] for c in result["planned"]] == [SHAPES[0]] * 2 + [SHAPES[1]] * 2
    passed = [all(o["passed"] for o in case["outputs"]) for case in result["cases"]]
    assert passed == [True, False, True, True]
    assert all(case["inputs_reproducible"] for case in result["cases"])
    assert result["cases"][1]["outputs"][0]["mismatched"] > 0


OOM_ONCE_TASK = '''
import torch

CALLS = [0]


class Model(torch.nn.Module):
    def forward(self, x):
        CALLS[0] += 1
        if CALLS[0] == 1:  # the device is full while the candidate runs beside us
            raise torch.OutOfMemoryError("out of memory (first call)")
        return x * 2


def get_inputs():
    return [torch.randn(4, 8)]


def get_init_inputs():
    return []
'''


def test_running_out_of_memory_ahead_of_the_candidate_is_not_a_reference_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_NONCE", "7")
    task = tmp_path / "task_oom_once.py"
    task.write_text(OOM_ONCE_TASK)
    result = _validate_as_the_candidate(
        tmp_path, monkeypatch,
        {"task": str(task), "seeds": 2, "shapes": None, "device": "cpu",
         "tolerances": {"float32": {"atol": 1e-4, "rtol": 1e-4}}, "ahead_host_bytes": 1 << 30},
        lambda cases_dir: [[case["inputs"][0] * 2] for case in handoff.read_cases(cases_dir, wait_s=60)])
    assert [case["error"] for case in result["cases"]] == [None, None]
    assert all(o["passed"] for case in result["cases"] for o in case["outputs"])


def test_cases_stream_to_the_candidate_within_a_window_and_finished_ones_are_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the inputs window the reference writes a case only once the candidate has finished
    an earlier one, and deletes that one's files: a problem whose cases do not fit the disk
    together still validates, with the same verdicts."""
    monkeypatch.setenv("LOOM_NONCE", "99")
    request = {"task": TASK, "seeds": 3, "shapes": SHAPES, "device": "cpu",
               "input_window_bytes": 1,  # every case is past the window
               "tolerances": {"bfloat16": {"atol": 1e-2, "rtol": 1e-2},
                              "float32": {"atol": 1e-4, "rtol": 1e-4}}}
    task = load_module(TASK, "rmsnorm_task_for_stream_test")
    seen_on_disk: list[list[str]] = []

    def candidate_one_at_a_time(cases_dir: Path, outputs_dir: Path) -> None:
        count = handoff.read_count(cases_dir, wait_s=60)
        for index in range(count):
            case = handoff.read_case(cases_dir, index, wait_s=60)
            seen_on_disk.append(sorted(p.name for p in cases_dir.iterdir() if p.is_dir()))
            model = task.Model(*case["init_inputs"])
            model.load_state_dict(case["state_dict"])
            with torch.no_grad():
                out = model(*case["inputs"])
            handoff.write_case(outputs_dir, index, [out * (1.5 if index == 4 else 1)])
        handoff.write_count(outputs_dir, count)

    worker, box, (cases_dir, outputs_dir, cand_go, ref_go) = _start_reference(tmp_path, monkeypatch, request)
    go = wait_for_go(cand_go, timeout_s=60)  # signed by the reference, naming the case count
    assert go == {"cases": 6}
    candidate_one_at_a_time(cases_dir, outputs_dir)
    publish_go(str(ref_go), {}, TOKEN)
    worker.join(120)
    result = box["result"]
    assert len(seen_on_disk) == 6
    # Never more than the window's two cases on disk (the one just finished is deleted when the
    # reference next needs room), so the first cases are gone by the last.
    for index, names in enumerate(seen_on_disk):
        assert len(names) <= 2, seen_on_disk
        assert all(int(n[1:]) >= index - 1 for n in names), seen_on_disk
    assert "c0" not in seen_on_disk[-1] and "c1" not in seen_on_disk[-1]
    passed = [all(o["passed"] for o in case["outputs"]) for case in result["cases"]]
    assert passed == [True, True, True, True, False, True]
