"""`loom-mcp install`: register the server with an MCP client and copy the loom skills.

    loom-mcp install --client claude|cursor|codex [--scope project|user] [--dry-run]
                     [--project-dir DIR] [--home DIR] [--env KEY=VALUE ...] [--no-skills]

Where each client reads its registration:

| client | project scope              | user scope            | skills (project / user)               |
|--------|----------------------------|-----------------------|---------------------------------------|
| claude | <project>/.mcp.json        | ~/.claude.json        | .claude/skills  / ~/.claude/skills    |
| cursor | <project>/.cursor/mcp.json | ~/.cursor/mcp.json    | .cursor/skills  / ~/.cursor/skills    |
| codex  | <project>/.codex/config.toml | ~/.codex/config.toml | .agents/skills / ~/.agents/skills    |

What the entry holds per client, and how an existing config is merged, is `client_config.py`;
the skills ship as package data and are copied by `skills.py`.

`--env KEY=VALUE` adds literal values for every client; `--home DIR` pins the state directory
through the command line (`loom-mcp --home DIR --stdio`), which every client passes verbatim.

Existing configs are merged, never clobbered: other servers and keys (and, in TOML, comments and
layout) are kept, an existing `loom` entry is replaced (and reported), a timestamped backup of
each changed file is written beside it, and an unreadable config is refused untouched.

stdout carries the registration entry as a standalone JSON/TOML document (the same with or
without --dry-run); progress and notes go to stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from loom_mcp.client_config import (
    CLIENTS,
    CODEX_ENV_VARS,
    CODEX_STARTUP_TIMEOUT_SEC,
    CODEX_TOOL_TIMEOUT_SEC,
    SCOPES,
    SERVER_NAME,
    InstallError,
    Merge,
    backup_path,
    build_entry,
    config_path,
    home_dir,
    merge_json,
    merge_toml,
    pretty_json,
    render_entry,
    server_command,
    skills_dir,
    toml_section,
    write_config,
)
from loom_mcp.skills import SKILLS_PACKAGE_DIR, install_skills, packaged_skills, skill_files

__all__ = [
    "CLIENTS",
    "CODEX_ENV_VARS",
    "CODEX_STARTUP_TIMEOUT_SEC",
    "CODEX_TOOL_TIMEOUT_SEC",
    "SCOPES",
    "SERVER_NAME",
    "SKILLS_PACKAGE_DIR",
    "InstallError",
    "Merge",
    "Options",
    "add_install_parser",
    "backup_path",
    "build_entry",
    "config_path",
    "home_dir",
    "install",
    "install_skills",
    "main",
    "merge_json",
    "merge_toml",
    "packaged_skills",
    "parse_env",
    "render_entry",
    "run_install",
    "server_command",
    "skill_files",
    "skills_dir",
    "toml_section",
    "write_config",
]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Options:
    client: str
    scope: str = "project"
    project_dir: Path | None = None
    dry_run: bool = False
    state_dir: Path | None = None  # loom's --home to pin in the entry (not the user's home)
    env: dict[str, str] = field(default_factory=dict)
    skills: bool = True


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(key):
            raise InstallError(f"--env expects KEY=VALUE with a valid variable name, got {pair!r}")
        env[key] = value
    return env


def _claude_local_shadow(home: Path, project_dir: Path) -> str | None:
    """A local-scope loom entry in ~/.claude.json wins over project and user scope: say so."""
    try:
        data = json.loads((home / ".claude.json").read_text(encoding="utf-8"))
        servers = data["projects"][str(project_dir)]["mcpServers"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(servers, dict) and SERVER_NAME in servers:
        return (
            f"note: ~/.claude.json also has a local-scope '{SERVER_NAME}' server for "
            f"{project_dir}; Claude Code prefers it (remove it: claude mcp remove --scope local "
            f"{SERVER_NAME})"
        )
    return None


def install(opts: Options, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr

    def say(message: str) -> None:
        print(message, file=err)

    if opts.client not in CLIENTS:
        raise InstallError(f"--client must be one of {', '.join(CLIENTS)}")
    if opts.scope not in SCOPES:
        raise InstallError(f"--scope must be one of {', '.join(SCOPES)}")
    home = home_dir()
    project_dir = (opts.project_dir or Path.cwd()).expanduser().absolute()
    if opts.scope == "project" and not project_dir.is_dir():
        raise InstallError(f"project directory {project_dir} does not exist")

    command, args = server_command()
    if opts.state_dir:
        args += ["--home", str(opts.state_dir.expanduser().absolute())]
    args.append("--stdio")
    entry = build_entry(opts.client, command, args, opts.env)
    path = config_path(opts.client, opts.scope, project_dir, home)

    old_text = None
    if path.exists():
        try:
            old_text = path.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as exc:
            raise InstallError(f"cannot read {path}: {exc}") from exc
    merger = merge_toml if opts.client == "codex" else merge_json
    merge = merger(path, old_text, entry)  # raises before anything is written

    print(render_entry(opts.client, entry), end="", file=out)
    prefix = "would " if opts.dry_run else ""
    if not merge.changed:
        say(f"{path}: the '{SERVER_NAME}' entry is already up to date")
    else:
        if merge.previous is not None:
            new_text = toml_section(entry) if opts.client == "codex" else pretty_json(entry)
            diff = difflib.unified_diff(
                merge.previous.splitlines(keepends=True),
                new_text.splitlines(keepends=True),
                f"{SERVER_NAME} (before)",
                f"{SERVER_NAME} (after)",
            )
            say(f"{path}: {prefix}replace the existing '{SERVER_NAME}' entry:")
            say("".join(diff).rstrip("\n"))
        elif old_text is not None:
            say(f"{path}: {prefix}add the '{SERVER_NAME}' entry (other entries and keys kept)")
        else:
            say(f"{path}: {prefix}create it with the '{SERVER_NAME}' entry")
        if not opts.dry_run:
            backup = write_config(path, merge.text, private=opts.scope == "user")
            if backup is not None:
                say(f"backup of the previous file: {backup}")

    if opts.skills:
        for note in install_skills(skills_dir(opts.client, opts.scope, project_dir, home), opts.dry_run):
            say(note)

    if opts.client == "claude":
        shadow = _claude_local_shadow(home, project_dir)
        if shadow:
            say(shadow)
        if opts.scope == "project":
            say("next: restart Claude Code in this project and approve the 'loom' server; check with /mcp")
        else:
            say("next: restart Claude Code; check with /mcp or `claude mcp list`")
    elif opts.client == "cursor":
        say("next: reload Cursor (Settings > MCP shows 'loom' with its tools)")
    else:
        if opts.scope == "project":
            say("note: Codex reads .codex/config.toml only in trusted projects; otherwise use --scope user")
        say("next: restart Codex; check with `codex mcp list`")
    if opts.dry_run:
        say("dry run: nothing was written")
    return 0


def add_install_parser(subparsers: Any) -> None:
    """Add `install` to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "install",
        help="register loom-mcp with Claude Code, Cursor or Codex and copy the loom skills",
        description="Register this loom-mcp with an MCP client (merging into its config, with a "
        "backup) and copy the loom skills where the client reads them. The entry is printed "
        "to stdout; notes go to stderr.",
    )
    _add_arguments(parser)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--client", required=True, choices=CLIENTS)
    parser.add_argument(
        "--scope",
        choices=SCOPES,
        default="project",
        help="project: config in the project directory (default); user: in ~",
    )
    parser.add_argument(
        "--project-dir",
        type=Path,
        default=None,
        help="project root for --scope project (default: the current directory)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the entry; write nothing")
    # SUPPRESS: without --home here, the top-level `loom-mcp --home DIR install` value stays.
    parser.add_argument(
        "--home",
        type=Path,
        default=argparse.SUPPRESS,
        help="pin loom's state directory in the entry (loom-mcp --home DIR)",
    )
    parser.add_argument(
        "--env",
        action="append",
        metavar="KEY=VALUE",
        help="a literal environment variable for the server (repeatable)",
    )
    parser.add_argument("--no-skills", action="store_true", help="do not copy the loom skills")


def run_install(args: argparse.Namespace) -> int:
    try:
        opts = Options(
            client=args.client,
            scope=args.scope,
            project_dir=args.project_dir,
            dry_run=args.dry_run,
            state_dir=getattr(args, "home", None),
            env=parse_env(args.env),
            skills=not args.no_skills,
        )
        return install(opts)
    except InstallError as exc:
        print(f"loom-mcp install: error: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loom-mcp install")
    _add_arguments(parser)
    return run_install(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
