"""`loom-mcp install` against real files under a temporary HOME and project directory."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loom_mcp import install as inst

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CLIENT_SCOPES = [(c, s) for c in inst.CLIENTS for s in inst.SCOPES]
BACKUP = re.compile(r"\.loom-backup-\d{8}-\d{6}(-\d+)?$")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture
def project(tmp_path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    return project


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = inst.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def args_for(client: str, scope: str, project: Path, *extra: str) -> list[str]:
    return ["--client", client, "--scope", scope, "--project-dir", str(project), *extra]


def config_file(client: str, scope: str, home: Path, project: Path) -> Path:
    return inst.config_path(client, scope, project, home)


def loom_entry(client: str, text: str) -> dict:
    if client == "codex":
        return tomllib.loads(text)["mcp_servers"]["loom"]
    return json.loads(text)["mcpServers"]["loom"]


def files_under(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*"))


def backups(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if BACKUP.search(p.name))


def no_interpolation(value) -> bool:
    """No ${VAR} anywhere: an unset variable would become '' (CUDA_VISIBLE_DEVICES='' hides GPUs)."""
    return "${" not in json.dumps(value)


# ---------------------------------------------------------------- dry run


@pytest.mark.parametrize("client,scope", CLIENT_SCOPES)
def test_dry_run_prints_a_valid_entry_and_writes_nothing(capsys, home, project, client, scope):
    code, out, err = run(capsys, *args_for(client, scope, project, "--dry-run"))
    assert code == 0, err
    entry = loom_entry(client, out)
    command = Path(entry["command"])
    assert command.is_absolute() and command.exists()
    assert entry["args"][-1] == "--stdio"
    assert no_interpolation(entry)
    if client == "claude":
        assert entry["type"] == "stdio"
        assert entry["env"] == {}
    elif client == "cursor":
        assert set(entry) == {"command", "args"}
    else:
        assert entry["startup_timeout_sec"] == 30
        assert entry["tool_timeout_sec"] == 1800
        assert {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                "LD_LIBRARY_PATH", "LOOM_HOME", "LOOM_ALLOWED_ROOTS"} <= set(entry["env_vars"])
    assert "dry run: nothing was written" in err
    assert "would copy" in err
    assert files_under(home, project) == []


def test_dry_run_leaves_an_existing_config_alone(capsys, home, project):
    path = project / ".mcp.json"
    path.write_text('{"mcpServers": {"other": {"command": "x"}}}\n')
    code, _, err = run(capsys, *args_for("claude", "project", project, "--dry-run"))
    assert code == 0, err
    assert path.read_text() == '{"mcpServers": {"other": {"command": "x"}}}\n'
    assert backups(path) == []


# ---------------------------------------------------------------- real installs


def existing_json(client: str) -> dict:
    data: dict = {"mcpServers": {"other": {"command": "/usr/bin/other", "args": ["--x"]}}}
    if client == "claude":
        # ~/.claude.json holds much more than servers; none of it may change.
        data = {"numStartups": 42, "theme": "dark", "projects": {"/somewhere": {"allowedTools": []}},
                **data, "tipsHistory": {"a": 1}}
    return data


@pytest.mark.parametrize("client,scope", [(c, s) for c, s in CLIENT_SCOPES if c != "codex"])
def test_json_merge_keeps_everything_else_backs_up_and_is_idempotent(
    capsys, home, project, client, scope
):
    path = config_file(client, scope, home, project)
    path.parent.mkdir(parents=True, exist_ok=True)
    original = existing_json(client)
    path.write_text(json.dumps(original, indent=2) + "\n")
    os.chmod(path, 0o600)

    code, out, err = run(capsys, *args_for(client, scope, project))
    assert code == 0, err
    data = json.loads(path.read_text())
    assert data["mcpServers"]["other"] == original["mcpServers"]["other"]
    assert data["mcpServers"]["loom"] == loom_entry(client, out)
    assert {k: v for k, v in data.items() if k != "mcpServers"} == {
        k: v for k, v in original.items() if k != "mcpServers"}
    assert list(data) == list(original), "top-level key order kept"
    assert path.stat().st_mode & 0o777 == 0o600
    [backup] = backups(path)
    assert json.loads(backup.read_text()) == original
    assert "add the 'loom' entry" in err and str(backup) in err

    first = path.read_text()
    code, _, err = run(capsys, *args_for(client, scope, project))
    assert code == 0, err
    assert path.read_text() == first
    assert len(backups(path)) == 1, "an unchanged file is not backed up again"
    assert "already up to date" in err


@pytest.mark.parametrize("client", ["claude", "cursor"])
def test_existing_loom_entry_is_replaced_and_reported(capsys, home, project, client):
    path = config_file(client, "project", home, project)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"mcpServers": {
        "loom": {"command": "loom-mcp", "args": ["--stdio"],
                 "env": {"CUDA_VISIBLE_DEVICES": "${CUDA_VISIBLE_DEVICES:-}"}},
        "other": {"command": "o"}}}, indent=2))
    code, out, err = run(capsys, *args_for(client, "project", project))
    assert code == 0, err
    data = json.loads(path.read_text())
    assert list(data["mcpServers"]) == ["loom", "other"], "the entry keeps its place"
    assert data["mcpServers"]["loom"] == loom_entry(client, out)
    assert data["mcpServers"]["other"] == {"command": "o"}
    assert "replace the existing 'loom' entry" in err
    assert "-    \"CUDA_VISIBLE_DEVICES\"" in err, "the diff of the old entry is shown"
    assert path.read_text().endswith("}"), "no trailing newline was added to a file without one"


def test_claude_user_scope_creates_a_private_file(capsys, home, project):
    code, _, err = run(capsys, *args_for("claude", "user", project))
    assert code == 0, err
    path = home / ".claude.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert backups(path) == []
    assert "create it" in err


def test_claude_warns_about_a_shadowing_local_entry(capsys, home, project):
    (home / ".claude.json").write_text(json.dumps(
        {"projects": {str(project): {"mcpServers": {"loom": {"command": "old"}}}}}))
    code, _, err = run(capsys, *args_for("claude", "project", project))
    assert code == 0, err
    assert "local-scope 'loom' server" in err


CODEX_EXISTING = """\
# my codex settings
model = "o3"  # keep this comment

[mcp_servers.other]
command = "other-server"
args = ["--flag"]

[mcp_servers.loom]
command = "loom-mcp"
args = ["--stdio"]
tool_timeout_sec = 60

[mcp_servers.loom.env]
CUDA_VISIBLE_DEVICES = "0"

# profiles below
[profiles.fast]
model = "o4-mini"
"""


@pytest.mark.parametrize("scope", inst.SCOPES)
def test_codex_merge_replaces_only_loom_and_keeps_comments(capsys, home, project, scope):
    path = config_file("codex", scope, home, project)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CODEX_EXISTING)
    code, out, err = run(capsys, *args_for("codex", scope, project))
    assert code == 0, err
    text = path.read_text()
    data = tomllib.loads(text)
    assert data["mcp_servers"]["loom"] == loom_entry("codex", out)
    assert "env" not in data["mcp_servers"]["loom"], "the old env subtable is gone"
    assert data["mcp_servers"]["other"] == {"command": "other-server", "args": ["--flag"]}
    assert data["profiles"] == {"fast": {"model": "o4-mini"}}
    assert data["model"] == "o3"
    for kept in ("# my codex settings", 'model = "o3"  # keep this comment', "# profiles below"):
        assert kept in text
    assert text.index("[mcp_servers.other]") < text.index("[mcp_servers.loom]") < text.index(
        "[profiles.fast]"), "the entry stays where it was"
    assert "replace the existing 'loom' entry" in err
    assert "\n\n\n" not in text, "no blank lines pile up where the old tables were"
    [backup] = backups(path)
    assert backup.read_text() == CODEX_EXISTING

    code, _, err = run(capsys, *args_for("codex", scope, project))
    assert code == 0, err
    assert path.read_text() == text
    assert len(backups(path)) == 1
    assert "already up to date" in err


def test_codex_appends_to_a_config_without_loom(capsys, home, project):
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text('model = "o3"\n[mcp_servers.other]\ncommand = "x"')  # no final newline
    code, out, err = run(capsys, *args_for("codex", "user", project, "--env", "LOOM_LOG_LEVEL=DEBUG"))
    assert code == 0, err
    text = path.read_text()
    assert text.startswith('model = "o3"\n[mcp_servers.other]\ncommand = "x"\n\n[mcp_servers.loom]\n')
    data = tomllib.loads(text)
    assert data["mcp_servers"]["other"] == {"command": "x"}
    assert data["mcp_servers"]["loom"]["env"] == {"LOOM_LOG_LEVEL": "DEBUG"}
    assert data["mcp_servers"]["loom"] == loom_entry("codex", out)
    code, _, _ = run(capsys, *args_for("codex", "user", project, "--env", "LOOM_LOG_LEVEL=DEBUG"))
    assert code == 0 and path.read_text() == text


def cli(home: Path, *argv: str) -> subprocess.CompletedProcess:
    """The installed command line, `loom-mcp install ...`, as a user runs it."""
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "loom_mcp.cli", "install", *argv],
                          capture_output=True, text=True, env=env, timeout=60)


CODEX_USER = """\
# ~/.codex/config.toml, written by hand
model = "o3"  # the default model
approval_policy = "on-request"

[tui]
# keep the notifications
notifications = true

[mcp_servers.docs]
command = "docs-server"  # read-only
args = ["--root", "/srv/docs"]

[profiles.fast]
model = "o4-mini"

[[hooks.on_start]]
run = "echo hi"

# servers added later
[mcp_servers.search]
command = "search-server"
"""


def test_codex_install_keeps_comments_order_and_other_tables(home, project):
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text(CODEX_USER)
    proc = cli(home, "--client", "codex", "--scope", "user", "--no-skills")
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert text.startswith(CODEX_USER + "\n[mcp_servers.loom]\n"), "nothing the user wrote moved"
    assert tomllib.loads(text)["mcp_servers"]["loom"] == loom_entry("codex", proc.stdout)

    # A changed entry is replaced where it stands; what surrounds it stays byte for byte.
    with_tail = text + "\n# trailing notes\n[profiles.slow]\nmodel = \"o3\"\n"
    path.write_text(with_tail)
    proc = cli(home, "--client", "codex", "--scope", "user", "--no-skills", "--env", "A=1")
    assert proc.returncode == 0, proc.stderr
    assert "replace the existing 'loom' entry" in proc.stderr
    assert '+env = {A = "1"}' in proc.stderr, "the diff shows what changed"
    new = path.read_text()
    head, _, rest = new.partition("[mcp_servers.loom]\n")
    assert head == CODEX_USER + "\n"
    assert rest.endswith("\n# trailing notes\n[profiles.slow]\nmodel = \"o3\"\n")
    data = tomllib.loads(new)
    assert data["mcp_servers"]["loom"]["env"] == {"A": "1"}
    assert data["mcp_servers"]["docs"] == {"command": "docs-server", "args": ["--root", "/srv/docs"]}
    assert data["tui"] == {"notifications": True}
    assert data["hooks"] == {"on_start": [{"run": "echo hi"}]}
    assert data["profiles"] == {"fast": {"model": "o4-mini"}, "slow": {"model": "o3"}}
    assert list(data) == ["model", "approval_policy", "tui", "mcp_servers", "profiles", "hooks"]
    assert list(data["mcp_servers"]) == ["docs", "search", "loom"]
    assert len(backups(path)) == 2
    assert sorted(b.read_text() for b in backups(path)) == sorted([CODEX_USER, with_tail])


@pytest.mark.parametrize("client,scope", CLIENT_SCOPES)
def test_reinstall_changes_nothing(home, project, client, scope):
    argv = ["--client", client, "--scope", scope, "--project-dir", str(project)]
    first = cli(home, *argv)
    assert first.returncode == 0, first.stderr
    written = {p: p.read_bytes() for p in files_under(home, project) if p.is_file()}
    assert config_file(client, scope, home, project) in written
    second = cli(home, *argv)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert {p: p.read_bytes() for p in files_under(home, project) if p.is_file()} == written
    assert "already up to date" in second.stderr
    assert second.stderr.count("is up to date") == len(inst.skill_files())
    dry = cli(home, *argv, "--dry-run")
    assert dry.returncode == 0 and dry.stdout == first.stdout and "would" not in dry.stderr


def test_codex_entry_written_by_the_old_text_writer_is_up_to_date(capsys, home, project):
    command, args = inst.server_command()
    old_writer = "\n".join([
        "[mcp_servers.loom]",
        "# loom-mcp GPU optimization server; `loom-mcp install --client codex` rewrites this table",
        f"command = {json.dumps(command)}",
        f"args = {json.dumps([*args, '--stdio'])}",
        "env_vars = [", *(f'  "{name}",' for name in inst.CODEX_ENV_VARS), "]",
        "startup_timeout_sec = 30",
        "tool_timeout_sec = 1800",
        "env = { LOOM_LOG_LEVEL = \"DEBUG\" }",
    ]) + "\n"
    path = project / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text('model = "o3"\n\n' + old_writer)
    code, _, err = run(capsys, *args_for("codex", "project", project, "--env", "LOOM_LOG_LEVEL=DEBUG"))
    assert code == 0, err
    assert "already up to date" in err
    assert path.read_text() == 'model = "o3"\n\n' + old_writer
    assert backups(path) == []


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "client,content",
    [
        ("claude", '{"mcpServers": {"other": {"command": "x"},}'),  # trailing comma, unclosed
        ("claude", '["not", "an", "object"]'),
        ("cursor", '{"mcpServers": ["x"]}'),
        ("codex", '[mcp_servers.other]\ncommand = "x"\ncommand = "y"\n'),  # duplicate key
        ("codex", 'mcp_servers = "nope"\n'),
        ("codex", '[mcp_servers]\nloom = { command = "x" }\n'),  # inline loom: not ours to edit
        ("codex", 'mcp_servers.loom.command = "x"\n'),  # dotted keys
        ("codex", '[mcp_servers.loom]\ncommand = "x"\n[z]\n[mcp_servers.loom.env]\nA = "1"\n'),  # split
    ],
)
def test_unusable_existing_config_is_refused_untouched(capsys, home, project, client, content):
    path = config_file(client, "project", home, project)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    before = files_under(home, project)
    code, out, err = run(capsys, *args_for(client, "project", project))
    assert code == 1
    assert out == ""
    assert "loom-mcp install: error:" in err and str(path) in err
    assert path.read_text() == content
    assert files_under(home, project) == before, "no backup, no skills, nothing else"


def test_bad_env_and_missing_project_dir_are_refused(capsys, home, project):
    code, _, err = run(capsys, *args_for("claude", "project", project, "--env", "1BAD=x"))
    assert code == 1 and "KEY=VALUE" in err
    code, _, err = run(capsys, *args_for("claude", "project", project / "nope"))
    assert code == 1 and "does not exist" in err
    assert files_under(home, project) == []


# ---------------------------------------------------------------- options


def test_home_and_env_options_shape_the_entry(capsys, home, project, tmp_path):
    state = tmp_path / "state"
    code, out, err = run(capsys, *args_for("cursor", "project", project, "--home", str(state),
                                           "--env", "A=1", "--env", "B=x=y", "--no-skills"))
    assert code == 0, err
    entry = loom_entry("cursor", out)
    assert entry["args"][-3:] == ["--home", str(state), "--stdio"]
    assert entry["env"] == {"A": "1", "B": "x=y"}
    assert not (project / ".cursor" / "skills").exists()


def test_install_parser_composes_with_the_cli_home_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", type=Path)
    inst.add_install_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["--home", "/a", "install", "--client", "codex"])
    assert args.command == "install" and args.home == Path("/a") and args.scope == "project"
    args = parser.parse_args(["install", "--client", "claude", "--home", "/b", "--dry-run"])
    assert args.home == Path("/b") and args.dry_run


def test_runs_as_a_program(home, project):
    env = {**os.environ, "HOME": str(home)}
    proc = subprocess.run([sys.executable, "-m", "loom_mcp.install", "--client", "claude",
                           "--project-dir", str(project), "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["mcpServers"]["loom"]["type"] == "stdio"


# ---------------------------------------------------------------- skills


@pytest.mark.parametrize("client,scope", CLIENT_SCOPES)
def test_skills_land_where_each_client_reads_them(capsys, home, project, client, scope):
    code, _, err = run(capsys, *args_for(client, scope, project))
    assert code == 0, err
    base = project if scope == "project" else home
    where = {"claude": ".claude/skills", "cursor": ".cursor/skills", "codex": ".agents/skills"}
    root = base / where[client]
    packaged = inst.skill_files()
    assert sorted(p.name for p in root.iterdir()) == sorted(packaged)
    for name, files in packaged.items():
        assert {p.relative_to(root / name).as_posix(): p.read_bytes()
                for p in (root / name).rglob("*") if p.is_file()} == files
        assert (root / name).stat().st_mode & 0o755 == 0o755, "readable by the client"


def test_stale_skill_is_replaced_and_a_symlinked_one_left_alone(capsys, home, project, tmp_path):
    root = project / ".claude" / "skills"
    (root / "loom-optimize").mkdir(parents=True)
    (root / "loom-optimize" / "SKILL.md").write_text("old")
    (root / "loom-optimize" / "stale.md").write_text("gone after install")
    linked = tmp_path / "checkout-skill"
    linked.mkdir()
    (linked / "SKILL.md").write_text("mine")
    (root / "loom-setup").symlink_to(linked)
    (root / "someone-else").mkdir()
    (root / "someone-else" / "SKILL.md").write_text("untouched")

    code, _, err = run(capsys, *args_for("claude", "project", project))
    assert code == 0, err
    optimize = inst.skill_files()["loom-optimize"]
    assert {p.name for p in (root / "loom-optimize").iterdir()} == set(optimize)
    assert (root / "loom-optimize" / "SKILL.md").read_bytes() == optimize["SKILL.md"]
    assert "replaced" in err and "left as is" in err
    assert (linked / "SKILL.md").read_text() == "mine"
    assert (root / "someone-else" / "SKILL.md").read_text() == "untouched"
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "no staging left behind"


# ---------------------------------------------------------------- the TOML writer


@pytest.mark.parametrize("value", ['a "quoted" \\ path', "tab\tnew\nline", "ünï €", "\x01\x7f", ""])
def test_toml_strings_round_trip(value):
    entry = {"command": value, "args": [value, "x"], "n": 3, "env": {"K": value, "we ird": value}}
    parsed = tomllib.loads(inst.toml_section(entry))["mcp_servers"]["loom"]
    assert parsed == entry
