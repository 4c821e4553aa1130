"""A candidate made of several files: the sources its SOURCES lists are what its jobs see of its
directory, are frozen with it on submit, and are part of its identity, so passed evidence for
one version of a helper is never reused for another. Through MCP, on CPU."""

from __future__ import annotations

import anyio
import git
import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.server import build_server

from .conftest import campaign_workspace, clear_win_demo_task

GATE = ("[gate]\naccept_wall_clock = true\nmax_plausible_speedup = 1000.0\nmax_time_s = 1.5\nmin_time_s = 0.5\n"
        "wall_clock_blocks = 4\nwall_clock_max_blocks = 8\nwall_clock_ci_target = 0.1\n")

SPLIT = '''
import torch

from norm_helper import fused

SOURCES = ["norm_helper.py"]


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return fused(x, self.weight)
'''
HONEST = '''
import torch


def fused(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
'''
CHEAT = '''
import torch


def fused(x, w):
    return torch.zeros_like(x)
'''


@pytest.fixture
def workspace(tmp_path):
    # A submit here must be accepted on CPU wall clock: see clear_win_demo_task.
    task = clear_win_demo_task()
    files = {"task.py": task, "split.py": SPLIT, "norm_helper.py": HONEST,
             "undeclared.py": SPLIT.replace('SOURCES = ["norm_helper.py"]\n', ""),
             "escapes.py": SPLIT.replace('["norm_helper.py"]', '["../outside.py"]'),
             "spawns.py": SPLIT.replace("norm_helper", "spawn_helper"),
             "spawn_helper.py": HONEST.replace("import torch\n", "import subprocess\nimport torch\n")}
    return campaign_workspace(tmp_path, files, GATE)


async def validate(client, repo, candidate: str) -> dict:
    result = await client.call_tool("run_validation", {"task": str(repo / "task.py"),
                                                       "candidate": str(repo / candidate)})
    assert result.is_error is False, result.content
    return result.structured_content


@pytest.mark.anyio
@pytest.mark.slow
async def test_declared_sources_are_seen_and_undeclared_ones_are_not(workspace):
    repo, home = workspace
    async with Client(build_server(load_config(home))) as client:
        split = await validate(client, repo, "split.py")
        undeclared = await validate(client, repo, "undeclared.py")
        escapes = await client.call_tool("run_validation", {"task": str(repo / "task.py"),
                                                            "candidate": str(repo / "escapes.py")})
        spawns = await validate(client, repo, "spawns.py")
    assert split["passed"], split["findings"]
    # A declared Python source is the candidate's code: the static checks read it too.
    assert not spawns["passed"]
    assert any(f["where"] and "spawn_helper.py" in f["where"] and f["severity"] == "error"
               for f in spawns["findings"]), spawns["findings"]
    assert not undeclared["passed"]
    assert "norm_helper" in str(undeclared), undeclared
    assert escapes.is_error is True
    assert "[BAD_INPUT]" in escapes.content[0].text and "SOURCES" in escapes.content[0].text


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_changed_source_is_validated_again_and_frozen_with_the_candidate(workspace):
    repo, home = workspace
    async with Client(build_server(load_config(home))) as client:
        campaign = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "split rmsnorm"})
        cid = campaign.structured_content["campaign_id"]
        checked = await validate(client, repo, "split.py")
        assert checked["passed"], checked["findings"]
        (repo / "norm_helper.py").write_text(CHEAT)  # same split.py bytes, another helper
        submitted = await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "split.py")})
        (repo / "norm_helper.py").write_text(HONEST)
        accepted = await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "split.py")})
    assert submitted.is_error is False, submitted.content
    result = submitted.structured_content
    assert result["validation_id"] != checked["validation_id"]
    assert result["verdict"] == "reject"
    assert "validation.mismatch" in result["reason_codes"], result["reason_codes"]  # the zeros ran
    assert accepted.is_error is False, accepted.content
    assert accepted.structured_content["verdict"] == "accept", accepted.structured_content["reasons"]
    commit = git.Repo(repo).commit(f"loom/{cid}")
    assert {"split.py", "norm_helper.py"} <= set(commit.stats.files)  # frozen with it, unasked
    assert (commit.tree / "norm_helper.py").data_stream.read().decode() == HONEST


@pytest.mark.anyio
@pytest.mark.parametrize("declared,expected", [
    ("[{}]", "literal list"),
    ('["' + "x" * 300 + '.py"]', "too long"),
    ('["helper.pyc"]', "only source files"),
    ('["a\\x00b.py"]', "not a plain file name"),
])
async def test_bad_sources_entries_are_bad_input(workspace, declared, expected):
    repo, home = workspace
    (repo / "odd.py").write_text(SPLIT.replace('["norm_helper.py"]', declared))
    async with Client(build_server(load_config(home))) as client:
        result = await client.call_tool("run_validation", {"task": str(repo / "task.py"),
                                                           "candidate": str(repo / "odd.py")})
    assert result.is_error is True
    text = result.content[0].text
    assert "[BAD_INPUT]" in text and expected in text, text


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_source_swapped_while_validation_runs_is_not_what_passed(workspace):
    """The job runs a server-owned copy, hashed before it starts: a helper swapped mid-run
    neither reaches the job nor becomes the bytes the passed validation stands for."""
    repo, home = workspace
    jobs = home / "jobs"

    async def swap_when_running() -> None:
        # Bounded: a validation that never reaches that point fails here, not hangs the suite.
        with anyio.fail_after(300):
            while not list(jobs.glob("v*/signals/ref.go")):
                await anyio.sleep(0.01)
        (repo / "norm_helper.py").write_text(CHEAT)

    async with Client(build_server(load_config(home))) as client:
        campaign = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "split rmsnorm"})
        cid = campaign.structured_content["campaign_id"]
        async with anyio.create_task_group() as tg:
            tg.start_soon(swap_when_running)
            checked = await validate(client, repo, "split.py")
        assert (repo / "norm_helper.py").read_text() == CHEAT
        submitted = await client.call_tool("submit_candidate", {
            "campaign_id": cid, "task": str(repo / "task.py"), "candidate": str(repo / "split.py")})
    assert checked["passed"], checked["findings"]  # the honest copy ran
    result = submitted.structured_content
    assert result["validation_id"] != checked["validation_id"]
    assert result["verdict"] == "reject" and "validation.mismatch" in result["reason_codes"]


@pytest.mark.anyio
async def test_compile_sees_the_task_file_not_its_directory(workspace):
    repo, home = workspace
    (repo / "leak.py").write_text("SECRET = 'undeclared'\n")
    (repo / "peek.py").write_text(SPLIT.replace("from norm_helper import fused", "from norm_helper import fused\nimport leak"))
    async with Client(build_server(load_config(home))) as client:
        result = await client.call_tool("compile_kernel", {"source": str(repo / "peek.py"), "language": "triton",
                                                           "task": str(repo / "task.py")})
    assert result.is_error is True
    assert "No module named 'leak'" in result.content[0].text, result.content[0].text


KERNEL_CU = "// the candidate's CUDA source, read beside it\n__global__ void noop() {}\n"
READS_CU = '''
from pathlib import Path

import torch

from norm_helper import fused

SOURCES = ["norm_helper.py", "kernel.cu"]
CUDA_SOURCE = {read}


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        assert "__global__" in CUDA_SOURCE
        return fused(x, self.weight)
'''
READ_DECLARED = 'Path(__file__).with_name("kernel.cu").read_text(encoding="utf-8")'


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_candidate_reads_its_declared_sources_and_nothing_else(workspace):
    """Reading a declared source passes the static checks and runs (the job sees the file);
    an undeclared file, a write to a declared one, or a computed name is a static.io error."""
    repo, home = workspace
    (repo / "kernel.cu").write_text(KERNEL_CU)
    (repo / "notes.cu").write_text(KERNEL_CU)  # beside it, undeclared
    variants = {
        "reads.py": READS_CU.format(read=READ_DECLARED),
        "undeclared.py": READS_CU.format(read=READ_DECLARED.replace("kernel.cu", "notes.cu")),
        "writes.py": READS_CU.format(read=READ_DECLARED)
        + '\nPath(__file__).with_name("kernel.cu").write_text("__global__ void k() {}")\n',
        "computed.py": READS_CU.format(read='Path(__file__).with_name("kernel" + ".cu").read_text()'),
        # a declared helper reads the candidate's source through its own SOURCES
        "helper_reads.py": READS_CU.replace('"norm_helper.py"', '"cu_helper.py"')
        .replace("from norm_helper", "from cu_helper")
        .format(read='"__global__"'),
        "cu_helper.py": HONEST + '\nfrom pathlib import Path\n\nSOURCES = ["kernel.cu"]\n'
        + f"CUDA_SOURCE = {READ_DECLARED}\n",
    }
    for name, text in variants.items():
        (repo / name).write_text(text)
    async with Client(build_server(load_config(home))) as client:
        found = {name: await validate(client, repo, name) for name in variants if name != "cu_helper.py"}
    assert found["reads.py"]["passed"], found["reads.py"]["findings"]
    assert found["helper_reads.py"]["passed"], found["helper_reads.py"]["findings"]
    for name in ("undeclared.py", "writes.py", "computed.py"):
        static = [f for f in found[name]["findings"] if f["severity"] == "error" and f["check"].startswith("static.")]
        assert not found[name]["passed"], name
        assert static and {f["check"] for f in static} == {"static.io"}, (name, static)
        assert all(f["where"].rsplit("/", 1)[-1].startswith(f"{name}:") for f in static), (name, static)
    # the undeclared file is not there for the job either: only declared sources are copied
    assert any(f["check"] == "validation.import" and "notes.cu" in f["message"] for f in found["undeclared.py"]["findings"])
