"""The server through the real MCP protocol, in process, in both protocol eras."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
from mcp import Client

from loom_mcp.config import load_config
from loom_mcp.errors import LoomError
from loom_mcp.server import INSTRUCTIONS, build_server
from loom_mcp.store import Ledger

SNAPSHOT = Path(__file__).parent / "snapshots" / "tools_list.json"


@pytest.fixture
def server(loom_home):
    return build_server(load_config(loom_home))


@pytest.fixture(params=["auto", "legacy"])
async def client(request, server):
    async with Client(server, mode=request.param) as c:
        yield c


def error_text(result) -> str:
    assert result.is_error is True
    return " ".join(getattr(c, "text", "") for c in result.content)


@pytest.mark.anyio
async def test_tools_list_matches_snapshot(client):
    listed = await client.list_tools()
    tools = sorted(
        (
            {
                "name": t.name,
                "title": t.title,
                "annotations": t.annotations.model_dump(exclude_none=True) if t.annotations else None,
                "inputSchema": t.input_schema,
                "outputSchema": t.output_schema,
            }
            for t in listed.tools
        ),
        key=lambda t: t["name"],
    )
    for tool in tools:
        assert tool["outputSchema"], f"{tool['name']} publishes no outputSchema"
        assert tool["annotations"], f"{tool['name']} has no annotations"
    if os.environ.get("LOOM_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(json.dumps(tools, indent=2, sort_keys=True) + "\n")
    expected = json.loads(SNAPSHOT.read_text())
    assert tools == expected, (
        "tools/list changed; if intended, regenerate with LOOM_UPDATE_SNAPSHOTS=1 pytest "
        "tests/test_server.py -k snapshot and review the diff"
    )


@pytest.mark.anyio
async def test_instructions_are_short_and_name_the_loop(client):
    assert len(INSTRUCTIONS) <= 512
    assert client.instructions == INSTRUCTIONS
    for step in ("device_info", "start_campaign", "run_validation", "benchmark", "submit_candidate"):
        assert step in INSTRUCTIONS


@pytest.mark.anyio
async def test_device_info_reports_cpu_and_toolchain(client, loom_home):
    seen: list[str | None] = []

    async def on_progress(progress, total, message):
        seen.append(message)

    result = await client.call_tool("device_info", {}, progress_callback=on_progress)
    assert result.is_error is False
    data = result.structured_content
    cpu = [d for d in data["devices"] if d["vendor"] == "cpu"]
    assert len(cpu) == 1 and cpu[0]["compute_units"] >= 1 and cpu[0]["memory_total_bytes"] > 0
    assert set(data["backends"]) >= {"nvidia", "amd", "cpu"}
    assert data["toolchain"]["python"]
    assert data["next_step"]
    rows = Ledger(loom_home / "ledger.sqlite3").calls(tool="device_info")
    assert rows and rows[-1].outcome == "ok"


@pytest.mark.anyio
async def test_start_campaign_records_base_commit(client, git_repo, loom_home):
    import git

    head = git.Repo(git_repo).head.commit.hexsha
    result = await client.call_tool(
        "start_campaign", {"repo": str(git_repo), "goal": "faster rmsnorm", "max_candidates": 3}
    )
    assert result.is_error is False, result.content
    data = result.structured_content
    assert data["base_commit"] == head and data["base_branch"] == "main"
    assert data["branch"] == f"loom/{data['campaign_id']}"
    assert data["budgets"]["candidates"] == 3
    ledger = Ledger(loom_home / "ledger.sqlite3")
    row = ledger.campaign(data["campaign_id"])
    assert row["base_commit"] == head and row["config_fingerprint"] == data["config_fingerprint"]
    assert ledger.calls(campaign_id=data["campaign_id"])[0].tool == "start_campaign"
    # The user's branch and working tree are untouched.
    repo = git.Repo(git_repo)
    assert repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)


@pytest.mark.anyio
async def test_budget_requests_are_capped_by_config(client, git_repo):
    result = await client.call_tool(
        "start_campaign", {"repo": str(git_repo), "goal": "x", "gpu_seconds": 1e12}
    )
    assert result.structured_content["budgets"]["gpu_seconds"] == 3600.0


@pytest.mark.anyio
async def test_start_campaign_errors_carry_codes(client, tmp_path, loom_home):
    outside = await client.call_tool("start_campaign", {"repo": "/", "goal": "x"})
    assert "[NOT_ALLOWED]" in error_text(outside)
    plain = tmp_path / "plain"
    plain.mkdir()
    assert "[BAD_INPUT]" in error_text(
        await client.call_tool("start_campaign", {"repo": str(plain), "goal": "x"})
    )
    import git

    empty = tmp_path / "empty"
    git.Repo.init(empty)
    assert "no commits yet" in error_text(
        await client.call_tool("start_campaign", {"repo": str(empty), "goal": "x"})
    )
    assert "[NOT_FOUND]" in error_text(
        await client.call_tool("start_campaign", {"repo": str(tmp_path / "missing"), "goal": "x"})
    )
    codes = [r.error_code for r in Ledger(loom_home / "ledger.sqlite3").calls(tool="start_campaign")]
    assert codes == ["NOT_ALLOWED", "BAD_INPUT", "BAD_INPUT", "NOT_FOUND"]


@pytest.mark.anyio
async def test_campaign_resource_and_prompt(client, git_repo):
    started = await client.call_tool("start_campaign", {"repo": str(git_repo), "goal": "x"})
    cid = started.structured_content["campaign_id"]
    read = await client.read_resource(f"loom://campaigns/{cid}")
    record = json.loads(read.contents[0].text)
    assert record["id"] == cid and record["calls"][0]["tool"] == "start_campaign"
    prompts = await client.list_prompts()
    assert "optimization_loop" in [p.name for p in prompts.prompts]
    prompt = await client.get_prompt("optimization_loop", {"goal": "decode tokens/s"})
    assert "decode tokens/s" in prompt.messages[0].content.text
    assert "absolute path" in prompt.messages[0].content.text  # "." would be refused by the tools
    prompt = await client.get_prompt("optimization_loop", {"goal": "g", "repo": str(git_repo)})
    assert f"Repository: {git_repo}" in prompt.messages[0].content.text


# ---- configuration (loom_mcp.config)
# load_config: loom.toml under the home and environment overrides, the verdict fingerprint,
# errors for unknown keys and bad TOML, and the allowed-roots check.


def test_home_and_overrides(tmp_path):
    home = tmp_path / "h"
    home.mkdir()
    (home / "loom.toml").write_text(
        f'allowed_roots = ["{tmp_path}"]\n[gate]\nmin_gain = 0.05\n[budgets]\ncandidates = 7\n'
    )
    config = load_config(home, environ={})
    assert config.home == home.resolve()
    assert config.gate.min_gain == 0.05 and config.budgets.candidates == 7
    assert config.allowed_roots == [tmp_path.resolve()]
    # The fingerprint follows the verdict-relevant settings.
    other = load_config(home, environ={"LOOM_ALLOWED_ROOTS": "/"})
    assert other.fingerprint() == config.fingerprint()
    (home / "loom.toml").write_text('[gate]\nmin_gain = 0.03\n')
    assert load_config(home, environ={}).fingerprint() != config.fingerprint()


def test_unknown_keys_and_bad_toml_are_errors(tmp_path):
    (tmp_path / "loom.toml").write_text("min_gian = 1\n")
    with pytest.raises(Exception, match="min_gian"):
        load_config(tmp_path, environ={})
    (tmp_path / "loom.toml").write_text("[gate\n")
    with pytest.raises(LoomError, match=r"\[CONFIG_INVALID\]"):
        load_config(tmp_path, environ={})


def test_allowed_roots_check(tmp_path):
    config = load_config(tmp_path / "home", environ={"LOOM_ALLOWED_ROOTS": str(tmp_path / "ok")})
    # The server's own state is always readable by the server (frozen candidates, worktrees).
    assert config.check_allowed(tmp_path / "home" / "worktrees" / "x", "task")
    assert config.check_allowed(tmp_path / "ok" / "repo", "repo") == (tmp_path / "ok" / "repo").resolve()
    with pytest.raises(LoomError, match=r"\[NOT_ALLOWED\]"):
        config.check_allowed(tmp_path / "okay-not", "repo")
    with pytest.raises(LoomError, match=r"\[NOT_ALLOWED\]"):
        config.check_allowed(tmp_path / "ok" / ".." / "elsewhere", "repo")


# ---- The layers docs/architecture.md names: every module placed, and imports only point down.


def _layers() -> list[tuple[str, list[str]]]:
    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    table = text.split("| layer | modules | job |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|") for line in table.splitlines()[2:] if line.startswith("|")]
    return [(row[1].strip(), [m.strip("/").replace("/", ".") for m in re.findall(r"`([^`]+)`", row[2])])
            for row in rows]


def _layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The layer of the longest listed prefix of `module` (`sandbox.policy` before `sandbox`)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def test_every_module_sits_in_a_layer_and_imports_only_point_down():
    layers = _layers()
    assert [name for name, _ in layers][0] == "contracts" and len(layers) >= 8
    package = Path(__file__).resolve().parents[1] / "loom_mcp"
    unplaced, upward = [], []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(p for p in parts if p != "__init__")
        if not module or parts[0] == "demo_data":
            continue
        layer = _layer_of(module, layers)
        if layer is None:
            unplaced.append(module)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loom_mcp."):
                targets = [node.module.removeprefix("loom_mcp.")]
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("loom_mcp.") for a in node.names if a.name.startswith("loom_mcp.")]
            else:
                continue
            for target in targets:
                target_layer = _layer_of(target, layers)
                if target_layer is not None and target_layer > layer:
                    upward.append(f"{module} ({layers[layer][0]}) imports {target} ({layers[target_layer][0]})")
    assert unplaced == [], f"modules docs/architecture.md's layer table does not place: {unplaced}"
    assert upward == []
