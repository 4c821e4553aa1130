"""The device pool (issue 26, one node): jobs take any free slot of their device kind, wait in a
first-come-first-served queue, hold the slot's file lease, and give it back on errors and
cancellation. First the pool itself (real leases, real tasks; fake GPU records where kinds
must differ), then run_validation through the real MCP protocol on pools of CPU slots."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import orjson
import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.executor.pool import DevicePool, Slot, device_kind
from loom_mcp.executor.slots import local_slots, visible_gpus
from loom_mcp.judge import store_record
from loom_mcp.models import DeviceInfo, RunValidationResult
from loom_mcp.sandbox import DeviceLease, lease_holder
from loom_mcp.server import build_server
from loom_mcp.store import ArtifactStore, Ledger

from .conftest import gpu_available

# A GPU host's pool is its GPUs: the pools of CPU slots below exist only where there is none.
cpu_slots_only = pytest.mark.skipif(gpu_available(), reason="a GPU host pools its GPUs, not cpu_slots")
CPU = DeviceInfo(index=0, vendor="cpu", name="test cpu")


def gpu(index: int, name: str = "NVIDIA H200", driver: str = "570.1") -> DeviceInfo:
    return DeviceInfo(index=index, vendor="nvidia", name=name, driver_version=driver, uuid=f"GPU-{index:04d}")


def gpu_slots(*devices: DeviceInfo) -> list[Slot]:
    return local_slots([*devices, CPU], use_gpus=True, cpu_slots=1)


def cpu_pool(lock_dir: Path, n: int, max_jobs: int | None = None) -> DevicePool:
    return DevicePool(local_slots([CPU], use_gpus=False, cpu_slots=n), lock_dir, max_jobs)


# ---------------------------------------------------------------- the pool itself


@pytest.mark.anyio
async def test_a_waiting_queue_is_served_first_come_first_served(tmp_path):
    pool = cpu_pool(tmp_path, 1)
    kind = pool.slots[0].kind
    order: list[int] = []
    release = anyio.Event()

    async def job(i: int) -> None:
        async with pool.take(kind, timeout_s=30) as (slot, placement):
            order.append(i)
            assert slot.name == "cpu:0" and placement.device == "cpu:0"
            if i == 0:
                await release.wait()

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(job, i)
            await anyio.sleep(0.02)  # arrival order 0..5
        assert pool.queued == 5 and order == [0]
        release.set()
    assert order == [0, 1, 2, 3, 4, 5]
    assert lease_holder(tmp_path, "cpu") is None


@pytest.mark.anyio
async def test_two_slots_run_two_jobs_at_once_and_one_slot_serializes(tmp_path):
    async def spans(pool: DevicePool) -> list[tuple[str, float, float]]:
        seen: list[tuple[str, float, float]] = []

        async def job() -> None:
            async with pool.take(pool.slots[0].kind, timeout_s=30) as (slot, _):
                start = time.monotonic()
                await anyio.sleep(0.3)
                seen.append((slot.name, start, time.monotonic()))

        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(job)
        return sorted(seen, key=lambda s: s[1])

    (a, b) = await spans(cpu_pool(tmp_path / "two", 2))
    assert {a[0], b[0]} == {"cpu:0", "cpu:1"} and b[1] < a[2]  # overlapping
    (a, b) = await spans(cpu_pool(tmp_path / "one", 1))
    assert a[0] == b[0] == "cpu:0" and b[1] >= a[2]  # one after the other
    (a, b) = await spans(cpu_pool(tmp_path / "capped", 2, max_jobs=1))
    assert b[1] >= a[2]  # max_jobs caps what runs at once below the slots


@pytest.mark.anyio
async def test_jobs_only_go_to_devices_of_their_kind(tmp_path):
    h200 = device_kind(gpu(0))
    h100 = device_kind(gpu(2, "NVIDIA H100"))
    newer_driver = device_kind(gpu(3, driver="575.0"))
    pool = DevicePool(gpu_slots(gpu(0), gpu(1), gpu(2, "NVIDIA H100"), gpu(3, driver="575.0")), tmp_path)
    assert len({h200, h100, newer_driver}) == 3  # the driver is part of the kind
    got: dict[str, list[str]] = {}
    hold = anyio.Event()

    async def job(kind: str, tag: str) -> None:
        async with pool.take(kind, timeout_s=30) as (slot, placement):
            assert slot.kind == placement.device_kind == kind
            got.setdefault(tag, []).append(slot.name)
            await hold.wait()

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(job, h200, f"h200-{i}")
        await anyio.sleep(0.1)
        tg.start_soon(job, h100, "h100")  # behind the waiting H200 job, on a device of its own
        await anyio.sleep(0.1)
        assert sorted(n for t, names in got.items() if t.startswith("h200") for n in names) == ["nvidia:0", "nvidia:1"]
        assert got["h100"] == ["nvidia:2"] and pool.queued == 1  # the third H200 job waits: no H200 free
        assert [s.busy for s in pool.state().slots] == [True, True, True, False]
        hold.set()
    assert sum(len(v) for v in got.values()) == 4 and "nvidia:3" not in str(got)
    with pytest.raises(LoomError, match="no device of kind") as err:
        async with pool.take("amd MI300X, driver 6.3", timeout_s=1):
            pass
    assert err.value.code is ErrorCode.DEVICE_BUSY


@pytest.mark.anyio
async def test_a_device_another_process_leased_is_skipped(tmp_path):
    """The queue orders this server's calls; the file lease still keeps another process's job
    (a second server, a benchmark script) alone on its device."""
    pool = DevicePool(gpu_slots(gpu(0), gpu(1)), tmp_path)
    kind = pool.slots[0].kind
    async with DeviceLease(tmp_path, "nvidia:0", timeout_s=1):  # its own open file: another holder
        assert [s.busy for s in pool.state().slots] == [True, False]
        async with pool.take(kind, timeout_s=5) as (slot, _):
            assert slot.name == "nvidia:1"
            with pytest.raises(LoomError, match="still busy after 0.3 s") as err:
                async with pool.take(kind, timeout_s=0.3):
                    pass
            assert err.value.code is ErrorCode.DEVICE_BUSY and pool.queued == 0
    async with pool.take(kind, timeout_s=5) as (slot, _):
        assert slot.name == "nvidia:0"  # free again: the pool polls for leases it does not own


@pytest.mark.anyio
async def test_leases_come_back_on_errors_and_cancellation(tmp_path):
    pool = cpu_pool(tmp_path, 1)
    kind = pool.slots[0].kind

    with pytest.raises(RuntimeError):
        async with pool.take(kind, timeout_s=5):
            raise RuntimeError("the job failed")
    assert lease_holder(tmp_path, "cpu") is None and not pool.state().slots[0].busy

    # Cancelled while holding the slot.
    with anyio.move_on_after(0.2):
        async with pool.take(kind, timeout_s=5):
            await anyio.sleep(30)
    assert lease_holder(tmp_path, "cpu") is None

    # Cancelled while waiting: it leaves the queue, and a slot handed to it in the same step as
    # its cancellation goes on to the next in line.
    for handed_over in (False, True):
        assert await cancelled_waiter(pool, handed_over) == ["holder", "next"], handed_over
        assert lease_holder(tmp_path, "cpu") is None and pool.queued == 0


async def cancelled_waiter(pool: DevicePool, handed_over: bool) -> list[str]:
    """A holder, a waiter that is cancelled (while waiting, or in the step the holder hands it
    the slot), and a waiter after it: which of them ran."""
    kind = pool.slots[0].kind
    ran: list[str] = []
    release = anyio.Event()
    scope = anyio.CancelScope()

    async def holder() -> None:
        async with pool.take(kind, timeout_s=5):
            ran.append("holder")
            await release.wait()
        if handed_over:
            assert pool.queued == 1  # the slot went to the cancelled waiter, not yet awake
            scope.cancel()

    async def waiter(name: str) -> None:
        async with pool.take(kind, timeout_s=5):
            ran.append(name)

    async def cancellable() -> None:
        with scope:
            await waiter("cancelled")

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder)
        await anyio.sleep(0.05)
        tg.start_soon(cancellable)
        await anyio.sleep(0.05)
        tg.start_soon(waiter, "next")
        await anyio.sleep(0.05)
        assert pool.queued == 2
        if not handed_over:
            scope.cancel()
            await anyio.sleep(0.05)
            assert pool.queued == 1
        release.set()
    return ran


# ---------------------------------------------------------------- slots and configuration


def test_slots_follow_the_visible_gpus(monkeypatch):
    gpus = [gpu(0), gpu(1), gpu(2)]
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert [s.name for s in gpu_slots(*gpus)] == ["nvidia:0", "nvidia:1", "nvidia:2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-0000")
    assert [g.index for g in visible_gpus(gpus)] == [2, 0]
    assert [(s.name, s.torch_device, s.lease_key) for s in gpu_slots(*gpus)] == [
        ("nvidia:2", "cuda:2", "nvidia:2"),
        ("nvidia:0", "cuda:0", "nvidia:0"),
    ]
    # No torch that sees a GPU: CPU slots, the first with the lease key a single CPU always had.
    cpus = local_slots([*gpus, CPU], use_gpus=False, cpu_slots=3)
    assert [(s.name, s.lease_key, s.torch_device) for s in cpus] == [
        ("cpu:0", "cpu", "cpu"),
        ("cpu:1", "cpu:1", "cpu"),
        ("cpu:2", "cpu:2", "cpu"),
    ]


def test_executor_settings_do_not_change_the_policy_fingerprint(tmp_path):
    def home(text: str) -> Path:
        path = tmp_path / str(abs(hash(text)))
        path.mkdir()
        (path / "loom.toml").write_text(text)
        return path

    plain = load_config(home(""), environ={})
    pooled = load_config(home('[executor]\nkind = "local"\nmax_jobs = 3\ncpu_slots = 4\n'), environ={})
    assert plain.executor.kind == "local" and plain.executor.max_jobs is None and plain.executor.cpu_slots == 1
    assert (pooled.executor.max_jobs, pooled.executor.cpu_slots) == (3, 4)
    assert pooled.fingerprint() == plain.fingerprint()
    assert pooled.source and plain.source and pooled.source.rules_fingerprint == plain.source.rules_fingerprint
    with pytest.raises(LoomError, match=r"loom.toml:2: executor.kind") as err:
        load_config(home('[executor]\nkind = "slurm"\n'), environ={})
    assert err.value.code is ErrorCode.CONFIG_INVALID
    with pytest.raises(LoomError, match="cpu_slots"):
        load_config(home("[executor]\ncpu_slots = 0\n"), environ={})


# ---------------------------------------------------------------- through the MCP protocol

TASK = '''import torch
SHAPES = [{"name": "s", "n": 64}]
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2
def get_inputs(n=64):
    return [torch.randn(n)]
def get_init_inputs(n=64):
    return []
'''
CANDIDATE = '''import torch
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + x
'''


def workspace(tmp_path: Path, toml: str, task: str = TASK) -> tuple[Path, Path]:
    """(directory holding task.py and candidate.py, LOOM_HOME with this loom.toml)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text(task)
    (work / "candidate.py").write_text(CANDIDATE)
    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text(f'allowed_roots = ["{tmp_path}"]\n{toml}')
    return work, home


async def validate(client: Client, work: Path, results: list, **extra) -> None:
    result = await client.call_tool(
        "run_validation", {"task": str(work / "task.py"), "candidate": str(work / "candidate.py"), **extra}
    )
    results.append(result)


async def placements(client: Client, results: list, by_start: bool = True) -> list[dict]:
    """Each run's placement as its record (loom://runs/{id}) states it, by start time (or in
    the order of `results`)."""
    found = []
    for result in results:
        assert result.is_error is False, result.content
        run = RunValidationResult.model_validate(result.structured_content)
        assert run.passed, run
        text = (await client.read_resource(f"loom://runs/{run.validation_id}")).contents[0].text
        found.append(orjson.loads(text)["placement"])
    return sorted(found, key=lambda p: p["started_at"]) if by_start else found


@pytest.mark.anyio
@pytest.mark.slow
@cpu_slots_only
async def test_concurrent_validations_run_at_once_on_two_slots(tmp_path):
    work, home = workspace(tmp_path, "[executor]\ncpu_slots = 2\n")
    async with Client(build_server(load_config(home))) as client:
        info = (await client.call_tool("device_info", {})).structured_content["executor"]
        assert info["kind"] == "local" and len(info["nodes"]) == 1
        assert info["slots"] == [{"device": "cpu:0", "busy": False}, {"device": "cpu:1", "busy": False}]
        results: list = []
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(validate, client, work, results)
        first, second = await placements(client, results)
        assert {first["device"], second["device"]} == {"cpu:0", "cpu:1"}
        assert second["started_at"] < first["ended_at"]  # the two jobs overlapped
        for placement in (first, second):
            assert placement["executor"] == "local" and placement["node"] == info["nodes"][0]
            assert placement["device_kind"].startswith("cpu ") and placement["queued_s"] < 1.0
        after = (await client.call_tool("device_info", {})).structured_content["executor"]
        assert not any(slot["busy"] for slot in after["slots"])


@pytest.mark.anyio
@pytest.mark.slow
@cpu_slots_only
async def test_concurrent_validations_on_one_slot_run_in_turn_first_come_first_served(tmp_path):
    work, home = workspace(tmp_path, "")
    async with Client(build_server(load_config(home))) as client:
        info = (await client.call_tool("device_info", {})).structured_content["executor"]
        assert info["slots"] == [{"device": "cpu:0", "busy": False}]
        results: list = []
        async with anyio.create_task_group() as tg:
            for i in range(3):
                # seeds tags each call (the policy's 5 or more); 0.4 s apart: they queue in order.
                tg.start_soon(lambda i=i: validate(client, work, results, seeds=5 + i))
                await anyio.sleep(0.4)
        spans = await placements(client, results)
        assert [p["device"] for p in spans] == ["cpu:0"] * 3
        for before, after in zip(spans, spans[1:]):
            assert after["started_at"] >= before["ended_at"]  # one at a time
            assert after["queued_s"] > 0.1  # and the later ones waited for it
        # First come, first served: taken in call order (seeds 5, 6, 7), the jobs started in order.
        in_call_order = sorted(results, key=lambda r: r.structured_content["seeds_per_shape"])
        assert [p["started_at"] for p in await placements(client, in_call_order, by_start=False)] == [
            p["started_at"] for p in spans
        ]
    assert [c.outcome for c in Ledger(home / "ledger.sqlite3").calls(tool="run_validation")] == ["ok"] * 3


@pytest.mark.anyio
@pytest.mark.slow
@cpu_slots_only
async def test_a_failed_or_cancelled_call_gives_its_slot_back(tmp_path):
    # The task's own inputs fail in the trusted reference, while the job holds its slot: an
    # error of the call ([BAD_INPUT]), not evidence against the candidate.
    broken = TASK.replace("    return [torch.randn(n)]", "    raise RuntimeError('the task is broken')")
    work, home = workspace(tmp_path, "", broken)
    async with Client(build_server(load_config(home))) as client:
        failed = await client.call_tool(
            "run_validation", {"task": str(work / "task.py"), "candidate": str(work / "candidate.py")}
        )
        assert failed.is_error and "[BAD_INPUT] the task's reference failed" in failed.content[0].text
        info = (await client.call_tool("device_info", {})).structured_content["executor"]
        assert info["slots"] == [{"device": "cpu:0", "busy": False}]
        assert lease_holder(home / "locks", "cpu") is None

        async with anyio.create_task_group() as tg:
            tg.start_soon(validate, client, work, [])
            with anyio.fail_after(10):
                while lease_holder(home / "locks", "cpu") is None:  # the job holds the slot
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # the client gives up: the server cancels the call
        with anyio.fail_after(10):
            while lease_holder(home / "locks", "cpu") is not None:
                await anyio.sleep(0.05)
        again = await client.call_tool(
            "run_validation", {"task": str(work / "task.py"), "candidate": str(work / "candidate.py")}
        )
        assert "the task is broken" in again.content[0].text  # it got the slot: the job ran again
    outcomes = [c.outcome for c in Ledger(home / "ledger.sqlite3").calls(tool="run_validation")]
    assert outcomes == ["error", "cancelled", "error"]


@pytest.mark.anyio
@pytest.mark.slow  # a fresh LOOM_HOME probes torch once
@cpu_slots_only
async def test_a_campaigns_jobs_stay_on_its_recorded_device_kind(tmp_path, git_repo):
    """A campaign whose evidence was recorded on an H200 (its LOOM_HOME moved to this CPU-only
    machine, say) is not judged on another kind of device: its speedups would not compare."""
    work, home = workspace(tmp_path, "")
    async with Client(build_server(load_config(home))) as client:
        started = await client.call_tool("start_campaign", {"repo": str(git_repo), "goal": "faster"})
        cid = started.structured_content["campaign_id"]
        ledger = Ledger(home / "ledger.sqlite3")
        artifacts = ArtifactStore(home / "artifacts", ledger)
        # The benchmark record an H200 host wrote for this campaign (records name their device).
        summary = RunValidationResult(
            validation_id="b-earlier", passed=True, device="cuda:0", shapes=[], seeds_per_shape=0,
            cases_total=0, cases_failed=0, failing_cases=[], findings=[], seconds=0.0, next_step="",
        )
        store_record(ledger, artifacts, "b-earlier", "benchmark", {"device": gpu(0).model_dump()}, summary, cid)
        refused = await client.call_tool("run_validation", {
            "task": str(work / "task.py"), "candidate": str(work / "candidate.py"), "campaign_id": cid})
        text = refused.content[0].text
        assert refused.is_error and "[DEVICE_BUSY]" in text
        assert device_kind(gpu(0)) in text and "not run elsewhere" in text


@pytest.mark.slow
@cpu_slots_only
def test_doctor_json_reports_the_executor(tmp_path):
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text("[executor]\ncpu_slots = 3\nmax_jobs = 2\n")
    loom = str(Path(sys.executable).with_name("loom-mcp"))
    env = {**os.environ, "LOOM_HOME": str(home), "LOOM_ALLOWED_ROOTS": str(tmp_path)}
    doctor = subprocess.run([loom, "doctor", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert doctor.returncode == 0, doctor.stderr[-2000:]
    executor = orjson.loads(doctor.stdout)["executor"]
    assert executor["kind"] == "local" and len(executor["nodes"]) == 1
    assert executor["slots"] == [{"device": f"cpu:{i}", "busy": False} for i in range(3)]
    text = subprocess.run([loom, "doctor"], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "executor: local on" in text and "  cpu:2: free" in text


@pytest.mark.anyio
@pytest.mark.slow
@cpu_slots_only
async def test_a_command_benchmark_names_where_it_ran(tmp_path):
    work, home = workspace(tmp_path, "[executor]\ncpu_slots = 2\n")
    program = work / "program.py"
    program.write_text("import json, random\nprint(json.dumps({'tokens_per_s': random.uniform(99, 101)}))\n")
    import sys

    async with Client(build_server(load_config(home))) as client:
        result = await client.call_tool("benchmark_command", {
            "baseline_command": [sys.executable, str(program)], "command": [sys.executable, str(program)],
            "runs": 3, "parser": "json"})
        assert result.is_error is False, result.content
        record = orjson.loads(
            (await client.read_resource(f"loom://runs/{result.structured_content['benchmark_id']}")).contents[0].text
        )
    placement = record["placement"]
    assert placement["executor"] == "local" and placement["device"] in ("cpu:0", "cpu:1")
    assert placement["ended_at"] >= placement["started_at"]
