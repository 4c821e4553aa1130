"""An agent's ordinary mistakes, made through the real protocol, come back coded ([BAD_INPUT],
[NOT_FOUND]) with what to do, never as [INTERNAL]; none of them spends campaign budget; and
tools/list stays small enough to leave the agent its context."""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

import git
import jsonschema
import orjson
import pytest
from mcp import Client
from mcp.types import JSONRPCResponse

from loom_mcp.config import load_config
from loom_mcp.server import build_server
from loom_mcp.store import Ledger
from loom_mcp.submissions import budget_usage

from .conftest import make_git_repo

DEMO = resources.files("loom_mcp") / "demo_data"
TOOLS_LIST_LIMIT = 20_000  # bytes on the wire; every agent carries them in context


@pytest.fixture
def server(loom_home):
    return build_server(load_config(loom_home))


@pytest.fixture
async def client(server):
    async with Client(server) as c:
        yield c


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = make_git_repo(tmp_path / "target")
    for name in ("task.py", "candidate.py"):
        (repo / name).write_text((DEMO / name).read_text())
    r = git.Repo(repo)
    r.index.add(["task.py"])
    r.index.commit("task")
    return repo


def error_text(result) -> str:
    assert result.is_error is True, result.structured_content
    text = " ".join(getattr(c, "text", "") for c in result.content)
    assert "[INTERNAL]" not in text, text
    return text


async def start(client, repo: Path) -> str:
    result = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "faster rmsnorm"})
    assert result.is_error is False, result.content
    return result.structured_content["campaign_id"]


def spent(loom_home: Path, campaign_id: str) -> float:
    ledger = Ledger(loom_home / "ledger.sqlite3")
    return budget_usage(ledger, ledger.campaign(campaign_id))["candidates"]


# ------------------------------------------------------------------------------ tools/list size


@pytest.mark.anyio
async def test_tools_list_fits_in_20_kb_and_keeps_typed_outputs(client):
    listed = await client.list_tools()
    # The response as the server writes it: the result dumped without nulls, in a JSON-RPC envelope.
    wire = JSONRPCResponse(jsonrpc="2.0", id=1, result=listed.model_dump(
        by_alias=True, mode="json", exclude_none=True)).model_dump_json(by_alias=True, exclude_unset=True)
    assert len(wire.encode()) <= TOOLS_LIST_LIMIT, f"tools/list is {len(wire.encode())} bytes"
    for tool in listed.tools:
        schema = tool.output_schema
        assert schema and schema["type"] == "object" and schema["required"], tool.name
        for name, prop in schema["properties"].items():
            assert "type" in prop or "anyOf" in prop, f"{tool.name}.{name} is untyped"
        assert "title" not in orjson.dumps(schema).decode(), tool.name
        # The full schema (nested models typed) is one resource read away.
        full = await client.read_resource(f"loom://schemas/{tool.name}")
        assert set(orjson.loads(full.contents[0].text)["properties"]) == set(schema["properties"])


@pytest.mark.anyio
async def test_structured_content_validates_against_both_schemas(client, repo):
    result = await client.call_tool("start_campaign", {"repo": str(repo), "goal": "x"})
    assert result.is_error is False
    published = {t.name: t.output_schema for t in (await client.list_tools()).tools}["start_campaign"]
    full = orjson.loads((await client.read_resource("loom://schemas/start_campaign")).contents[0].text)
    jsonschema.validate(result.structured_content, published)
    jsonschema.validate(result.structured_content, full)
    for wrong in ({"budgets": "none"}, {"base_branch": 3}):  # still typed: wrong types fail
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**result.structured_content, **wrong}, published)


# ------------------------------------------------------------------------------ arguments


@pytest.mark.anyio
async def test_wrong_type_and_missing_arguments_are_bad_input_naming_the_fields(client, repo):
    text = error_text(await client.call_tool(
        "run_validation", {"task": str(repo / "task.py"), "candidate": 5, "seeds": "many"}))
    assert "[BAD_INPUT]" in text and "candidate: Input should be a valid string" in text
    assert "seeds:" in text and "validation error" not in text and "errors.pydantic.dev" not in text
    text = error_text(await client.call_tool("run_validation", {"task": str(repo / "task.py")}))
    assert "[BAD_INPUT]" in text and "candidate: required" in text
    assert "run_validation takes task, candidate, seeds?" in text


@pytest.mark.anyio
async def test_unknown_arguments_are_refused_by_name(client, repo, loom_home):
    campaign_id = await start(client, repo)
    text = error_text(await client.call_tool(
        "campaign_report", {"campaign_id": campaign_id, "verbose": True}))
    assert "[BAD_INPUT]" in text and "verbose: not an argument of campaign_report" in text
    text = error_text(await client.call_tool(
        "submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "task.py"),
                             "candidate": str(repo / "candidate.py"), "shape": ["decode"]}))
    assert "shape: not an argument of submit_candidate" in text
    assert spent(loom_home, campaign_id) == 0


@pytest.mark.anyio
async def test_unknown_tool_is_not_found_and_lists_the_tools(client):
    text = error_text(await client.call_tool("validate", {}))
    assert "[NOT_FOUND]" in text and "run_validation" in text


@pytest.mark.anyio
async def test_argument_errors_are_coded_over_the_2025_protocol_too(server):
    async with Client(server, mode="legacy") as legacy:
        text = error_text(await legacy.call_tool("campaign_report", {"campaign": "c1"}))
        assert "[BAD_INPUT]" in text and "campaign: not an argument of campaign_report" in text
        assert "campaign_id: required" in text


# ------------------------------------------------------------------------------ paths


@pytest.mark.anyio
async def test_relative_path_without_a_campaign_is_refused(client, repo, monkeypatch):
    monkeypatch.chdir(repo)  # where the file is: the server's cwd must still not be used
    text = error_text(await client.call_tool(
        "run_validation", {"task": "task.py", "candidate": str(repo / "candidate.py")}))
    assert "[BAD_INPUT]" in text and "task='task.py'" in text and "absolute path" in text
    text = error_text(await client.call_tool("analyze_trace", {"trace": "trace.json"}))
    assert "[NOT_FOUND] no trace id" in text and "'trace.json'" in text and "absolute path" in text


@pytest.mark.anyio
async def test_a_json_file_that_is_not_a_trace_is_bad_input(client, tmp_path):
    (tmp_path / "numbers.json").write_text("[1, 2, 3]")
    text = error_text(await client.call_tool("analyze_trace", {"trace": str(tmp_path / "numbers.json")}))
    assert "[BAD_INPUT] numbers.json" in text and "not a Kineto/PyTorch trace" in text


@pytest.mark.anyio
async def test_relative_path_resolves_against_the_campaign_repository(client, repo, tmp_path, monkeypatch):
    campaign_id = await start(client, repo)
    monkeypatch.chdir(tmp_path)
    text = error_text(await client.call_tool(
        "benchmark", {"task": "missing_task.py", "candidate": "candidate.py", "campaign_id": campaign_id}))
    assert f"[NOT_FOUND] task file {repo / 'missing_task.py'} does not exist" in text
    text = error_text(await client.call_tool(
        "run_validation", {"task": "task.py", "candidate": "c.py", "campaign_id": "c-nope"}))
    assert "[NOT_FOUND] no campaign 'c-nope'" in text


@pytest.mark.anyio
async def test_overlong_paths_are_bad_input(client, repo, tmp_path):
    campaign_id = await start(client, repo)
    long = "/" + "a" * 5000
    component = str(tmp_path / ("b" * 300))
    calls = [
        ("run_validation", {"task": long, "candidate": str(repo / "candidate.py")}),
        ("benchmark", {"task": str(repo / "task.py"), "candidate": component}),
        ("compile_kernel", {"source": long, "language": "triton"}),
        ("analyze_trace", {"trace": component + ".json"}),
        ("profile", {"task": long}),
        ("start_campaign", {"repo": long, "goal": "x"}),
        ("submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "task.py"), "candidate": long}),
    ]
    for tool, arguments in calls:
        text = error_text(await client.call_tool(tool, arguments))
        assert "[BAD_INPUT]" in text and "longer than the file system allows" in text, (tool, text)


# ------------------------------------------------------------------------------ submissions


@pytest.mark.anyio
async def test_binary_candidate_is_bad_input_and_spends_no_budget(client, repo, loom_home):
    campaign_id = await start(client, repo)
    (repo / "blob.py").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe binary")
    text = error_text(await client.call_tool(
        "submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "task.py"),
                             "candidate": str(repo / "blob.py")}))
    assert "[BAD_INPUT]" in text and "not UTF-8 text" in text and "blob.py" in text
    assert "/worktrees/" not in text  # names the agent's file, not the server's copy
    text = error_text(await client.call_tool(
        "run_validation", {"task": str(repo / "task.py"), "candidate": str(repo / "blob.py")}))
    assert "[BAD_INPUT]" in text
    assert spent(loom_home, campaign_id) == 0
    assert Ledger(loom_home / "ledger.sqlite3").submissions(campaign_id) == []


@pytest.mark.anyio
async def test_missing_task_is_not_found_and_spends_no_budget(client, repo, loom_home):
    campaign_id = await start(client, repo)
    for _ in range(2):
        text = error_text(await client.call_tool(
            "submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "not_yet.py"),
                                 "candidate": str(repo / "candidate.py")}))
        assert f"[NOT_FOUND] task file {repo / 'not_yet.py'} does not exist" in text
    assert spent(loom_home, campaign_id) == 0


@pytest.mark.anyio
async def test_candidate_inside_a_submodule_is_bad_input(client, repo, tmp_path, loom_home):
    library = make_git_repo(tmp_path / "library")
    (library / "cand.py").write_text((DEMO / "candidate.py").read_text())
    git.Repo(library).index.add(["cand.py"])
    git.Repo(library).index.commit("candidate")
    subprocess.run(["git", "-c", "protocol.file.allow=always", "submodule", "add", str(library), "sub"],
                   cwd=repo, check=True, capture_output=True)
    subprocess.run(["git", "commit", "-qm", "submodule"], cwd=repo, check=True)
    campaign_id = await start(client, repo)
    text = error_text(await client.call_tool(
        "submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "task.py"),
                             "candidate": str(repo / "sub" / "cand.py")}))
    assert "[BAD_INPUT]" in text and "'sub'" in text and "submodule" in text
    assert spent(loom_home, campaign_id) == 0


@pytest.mark.slow
@pytest.mark.anyio
async def test_unknown_shape_is_bad_input(client, repo):
    text = error_text(await client.call_tool(
        "benchmark", {"task": str(repo / "task.py"), "candidate": str(repo / "candidate.py"),
                      "shapes": ["nope"]}))
    assert "[BAD_INPUT]" in text and "unknown shape(s) ['nope']" in text and "decode_t1_h4096" in text


EAGER_CANDIDATE = """import torch


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
"""


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_broken_task_written_after_start_voids_the_submission(client, repo, loom_home):
    """A task written after start_campaign (so not at the campaign tip) is judged from its
    snapshot; its reference failing is not the candidate's fault and spends no budget."""
    campaign_id = await start(client, repo)
    broken = (DEMO / "task.py").read_text().replace(
        "def get_inputs(tokens: int = 64, hidden: int = 4096):\n",
        "def get_inputs(tokens: int = 64, hidden: int = 4096):\n    raise RuntimeError('task bug')\n")
    (repo / "broken_task.py").write_text(broken)
    (repo / "eager.py").write_text(EAGER_CANDIDATE)
    # Judged by validation (eager code), and by the compile run on the task's first shape (Triton).
    for candidate in ("eager.py", "candidate.py"):
        text = error_text(await client.call_tool(
            "submit_candidate", {"campaign_id": campaign_id, "task": str(repo / "broken_task.py"),
                                 "candidate": str(repo / candidate)}))
        assert "[BAD_INPUT]" in text and "task bug" in text and "does not exist" not in text
    rows = Ledger(loom_home / "ledger.sqlite3").submissions(campaign_id)
    assert [r["status"] for r in rows] == ["void", "void"]
    assert spent(loom_home, campaign_id) == 0
