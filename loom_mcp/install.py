"""`loom-mcp install`: register the server with an MCP client and copy the loom skills.

    loom-mcp install --client claude|cursor|codex [--scope project|user] [--dry-run]
                     [--project-dir DIR] [--home DIR] [--env KEY=VALUE ...] [--no-skills]

Where each client reads its registration:

| client | project scope              | user scope            | skills (project / user)               |
|--------|----------------------------|-----------------------|---------------------------------------|
| claude | <project>/.mcp.json        | ~/.claude.json        | .claude/skills  / ~/.claude/skills    |
| cursor | <project>/.cursor/mcp.json | ~/.cursor/mcp.json    | .cursor/skills  / ~/.cursor/skills    |
| codex  | <project>/.codex/config.toml | ~/.codex/config.toml | .agents/skills / ~/.agents/skills    |

Environment, decided per client because each forwards it differently:

* Claude Code and Cursor start stdio servers with their own environment, plus the entry's `env`.
  GPU selection, toolkit paths and LOOM_* therefore already reach loom, and the entry carries no
  `${VAR}` references: interpolation reads the same environment the child inherits anyway, and
  only adds failure modes. `${VAR:-}` (Claude) or `${env:VAR}` (Cursor) of an unset variable
  yields an empty string, and CUDA_VISIBLE_DEVICES="" hides every GPU from torch, so loom would
  quietly time on the CPU; Claude passes an unset bare `${VAR}` on as literal text.
* Codex starts stdio servers with a fixed whitelist (HOME, PATH, USER, LANG, TERM, TMPDIR, ...)
  plus the names in `env_vars`, skipping names that are unset. So the entry lists what loom and
  its workers read: device visibility, toolkit locations, loom's own settings and the XDG
  directories its default state path derives from.

`--env KEY=VALUE` adds literal values for every client; `--home DIR` pins the state directory
through the command line (`loom-mcp --home DIR --stdio`), which every client passes verbatim.

The command is the absolute path of this installation's `loom-mcp`, so the client does not
depend on the user's shell PATH (GUI-launched editors often have a different one).

Existing configs are merged, never clobbered: other servers and keys are kept, an existing
`loom` entry is replaced (and reported), a timestamped backup of each changed file is written
beside it, and an unreadable config is refused untouched. TOML is edited as text (only loom's
own tables are replaced) so the user's comments and layout survive; the result is re-parsed
and compared with the original before anything is written.

stdout carries the registration entry as a standalone JSON/TOML document (the same with or
without --dry-run); progress and notes go to stderr.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:  # moved to importlib.resources.abc in 3.11
        from importlib.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SERVER_NAME = "loom"
CLIENTS = ("claude", "cursor", "codex")
SCOPES = ("project", "user")
SKILLS_PACKAGE_DIR = "skills_data"

# Forwarded by Codex when set in its environment (unset names are skipped, so listing a name is
# never harmful). PATH is already in Codex's default whitelist.
CODEX_ENV_VARS: tuple[str, ...] = (
    # which GPUs torch in the workers may see
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    # toolkit locations: nvcc / hipcc / ncu / nsys / rocprofv3 and the libraries they load
    "CUDA_HOME",
    "CUDA_PATH",
    "ROCM_PATH",
    "HIP_PATH",
    "LD_LIBRARY_PATH",
    # loom's own settings
    "LOOM_HOME",
    "LOOM_ALLOWED_ROOTS",
    "LOOM_LOG_LEVEL",
    # the default LOOM_HOME and caches derive from these (platformdirs)
    "XDG_STATE_HOME",
    "XDG_CACHE_HOME",
    "TRITON_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
)
# Codex's defaults (10 s start, 60 s per call) are too short: the first start probes the
# toolchain, and a benchmark or validation over a shape sweep runs for minutes.
CODEX_STARTUP_TIMEOUT_SEC = 30
CODEX_TOOL_TIMEOUT_SEC = 1800

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class InstallError(Exception):
    """A problem the user must fix; nothing has been written when it is raised."""


# ---------------------------------------------------------------- where things go


def home_dir() -> Path:
    # HOME first, so tests (and users with a non-standard setup) can redirect every user path.
    home = os.environ.get("HOME")
    return Path(home) if home else Path.home()


def config_path(client: str, scope: str, project_dir: Path, home: Path) -> Path:
    if client == "claude":
        return project_dir / ".mcp.json" if scope == "project" else home / ".claude.json"
    if client == "cursor":
        return (project_dir if scope == "project" else home) / ".cursor" / "mcp.json"
    if client == "codex":
        return (project_dir if scope == "project" else home) / ".codex" / "config.toml"
    raise InstallError(f"unknown client {client!r}")


def skills_dir(client: str, scope: str, project_dir: Path, home: Path) -> Path:
    base = project_dir if scope == "project" else home
    # Claude Code does not read .agents/skills; Codex reads nothing else; Cursor reads both
    # .agents and .cursor, so it gets its own directory only (one copy, no duplicate entries).
    sub = {"claude": ".claude", "cursor": ".cursor", "codex": ".agents"}[client]
    return base / sub / "skills"


def server_command() -> tuple[str, list[str]]:
    """Absolute command (and leading args) that starts this installation's server.

    The script beside the running interpreter comes first: it belongs to the same environment
    as the package doing the install, whereas PATH may lead to another virtualenv's copy.
    """
    bindir = Path(sys.executable).parent  # not resolved: a venv's python is often a symlink
    for name in ("loom-mcp", "loom-mcp.exe"):
        candidate = bindir / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate.absolute()), []
    found = shutil.which("loom-mcp")
    if found:
        return str(Path(found).absolute()), []
    # No console script (e.g. a source tree on PYTHONPATH): the module runs the same CLI.
    return str(Path(sys.executable).absolute()), ["-m", "loom_mcp.cli"]


# ---------------------------------------------------------------- the entry


def build_entry(client: str, command: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    if client == "claude":
        # Same shape `claude mcp add` writes; env stays empty unless asked (see module doc).
        return {"type": "stdio", "command": command, "args": args, "env": dict(env)}
    if client == "cursor":
        entry: dict[str, Any] = {"command": command, "args": args}
        if env:
            entry["env"] = dict(env)
        return entry
    if client == "codex":
        entry = {
            "command": command,
            "args": args,
            "env_vars": list(CODEX_ENV_VARS),
            "startup_timeout_sec": CODEX_STARTUP_TIMEOUT_SEC,
            "tool_timeout_sec": CODEX_TOOL_TIMEOUT_SEC,
        }
        if env:
            entry["env"] = dict(env)
        return entry
    raise InstallError(f"unknown client {client!r}")


def render_entry(client: str, entry: dict[str, Any]) -> str:
    """The entry as a standalone, valid document (what stdout shows)."""
    if client == "codex":
        return toml_section(entry)
    return json.dumps({"mcpServers": {SERVER_NAME: entry}}, indent=2, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- TOML: emit the subset we need


def _toml_string(value: str) -> str:
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")  # other control characters are not allowed raw
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    # bool before int: bool is a subclass of int in Python.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        inline = "[" + ", ".join(_toml_string(v) for v in value) + "]"
        if len(inline) <= 72:
            return inline
        return "[\n" + "".join(f"  {_toml_string(v)},\n" for v in value) + "]"
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        # An inline table keeps the whole entry inside one [table], so replacing it later is
        # one contiguous block of text.
        return (
            "{ " + ", ".join(f"{_toml_key(k)} = {_toml_string(v)}" for k, v in value.items()) + " }"
        )
    raise TypeError(f"cannot write {type(value).__name__} as TOML here")


def toml_section(entry: dict[str, Any]) -> str:
    lines = [
        f"[mcp_servers.{SERVER_NAME}]",
        "# loom-mcp GPU optimization server; `loom-mcp install --client codex` rewrites this table",
    ]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- merging


@dataclass
class Merge:
    text: str  # the whole new file
    previous: str | None  # the old loom entry as text, when there was one
    changed: bool
    notes: list[str] = field(default_factory=list)


def _json_indent(text: str) -> int | str:
    for line in text.splitlines()[1:]:
        stripped = line.lstrip(" \t")
        if stripped and len(stripped) < len(line):
            prefix = line[: len(line) - len(stripped)]
            return "\t" if prefix.startswith("\t") else len(prefix)
    return 2


def merge_json(path: Path, old_text: str | None, entry: dict[str, Any]) -> Merge:
    data: Any = {}
    if old_text is not None and old_text.strip():
        try:
            data = json.loads(old_text)
        except json.JSONDecodeError as exc:
            raise InstallError(
                f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                "fix it or move it aside, then run install again"
            ) from exc
    if not isinstance(data, dict):
        raise InstallError(f"{path}: the top level is a JSON {type(data).__name__}, not an object")
    servers = data.get("mcpServers")
    if servers is None:
        servers = data["mcpServers"] = {}
    if not isinstance(servers, dict):
        raise InstallError(f"{path}: 'mcpServers' is a {type(servers).__name__}, not an object")
    previous = servers.get(SERVER_NAME)
    if previous == entry:
        return Merge(old_text or "", _pretty(previous), changed=False)
    servers[SERVER_NAME] = entry  # an existing key keeps its position; a new one goes last
    indent = _json_indent(old_text) if old_text else 2
    trailing = "\n" if old_text is None or old_text.endswith("\n") or not old_text.strip() else ""
    text = json.dumps(data, indent=indent, ensure_ascii=False) + trailing
    return Merge(text, _pretty(previous) if previous is not None else None, changed=True)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


_LOOM_HEADER = re.compile(
    r"""^[ \t]*\[[ \t]*mcp_servers[ \t]*\.[ \t]*(?:loom|"loom"|'loom')[ \t]*(?:\.[^\]\n]*)?\]"""
    r"""[ \t]*(?:\#.*)?$"""
)
# Any table or array-of-tables header. Strict enough that a line of a multi-line array
# (`["a", "b"],`) is not mistaken for one.
_ANY_HEADER = re.compile(r"""^[ \t]*\[\[?[ \t]*[A-Za-z0-9_\-."' \t]+\]\]?[ \t]*(?:\#.*)?$""")


def _loom_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """[start, end) line ranges of every [mcp_servers.loom...] table, trailing blanks excluded."""
    headers = [i for i, line in enumerate(lines) if _ANY_HEADER.match(line.rstrip("\r\n"))]
    blocks = []
    for n, start in enumerate(headers):
        if not _LOOM_HEADER.match(lines[start].rstrip("\r\n")):
            continue
        end = headers[n + 1] if n + 1 < len(headers) else len(lines)
        # Blank and comment lines before the next header belong to what follows.
        while end > start + 1 and (
            not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")
        ):
            end -= 1
        blocks.append((start, end))
    return blocks


def _without_loom(data: dict[str, Any]) -> dict[str, Any]:
    copy = dict(data)
    servers = copy.get("mcp_servers")
    if isinstance(servers, dict):
        servers = {k: v for k, v in servers.items() if k != SERVER_NAME}
        if servers:
            copy["mcp_servers"] = servers
        else:
            copy.pop("mcp_servers")
    return copy


def merge_toml(path: Path, old_text: str | None, entry: dict[str, Any]) -> Merge:
    section = toml_section(entry)
    old_text = old_text or ""
    try:
        before = tomllib.loads(old_text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(
            f"{path} is not valid TOML ({exc}); fix it, then run install again"
        ) from exc
    servers = before.get("mcp_servers", {})
    if not isinstance(servers, dict):
        raise InstallError(f"{path}: 'mcp_servers' is not a table")
    if servers.get(SERVER_NAME) == tomllib.loads(section)["mcp_servers"][SERVER_NAME]:
        return Merge(old_text, section, changed=False)

    lines = old_text.splitlines(keepends=True)
    blocks = _loom_blocks(lines)
    previous = "".join("".join(lines[s:e]) for s, e in blocks) or None
    if blocks:
        drop = {i for s, e in blocks for i in range(s, e)}
        for s, _ in blocks[1:]:
            # Blank lines between two of loom's tables go with them, or each run would leave
            # one more behind.
            k = s - 1
            while k >= 0 and not lines[k].strip() and k not in drop:
                k -= 1
            if k in drop:
                drop.update(range(k + 1, s))
        first = blocks[0][0]
        out = [line for i, line in enumerate(lines[:first]) if i not in drop]
        out.append(section)
        out += [line for i, line in enumerate(lines[first:], start=first) if i not in drop]
        text = "".join(out)
    else:
        text = old_text
        if text and not text.endswith("\n"):
            text += "\n"
        if text.strip() and not text.endswith("\n\n"):
            text += "\n"
        text += section

    # Text surgery is only trusted once the result parses to: the old document minus loom's
    # tables, plus exactly the new entry.
    try:
        after = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(_toml_refusal(path, f"the merged file would not parse ({exc})")) from exc
    got = after.get("mcp_servers", {}).get(SERVER_NAME)
    if got != tomllib.loads(section)["mcp_servers"][SERVER_NAME] or _without_loom(
        after
    ) != _without_loom(before):
        raise InstallError(_toml_refusal(path, "the merge would change more than the loom entry"))
    if previous is None and SERVER_NAME in servers:
        previous = toml_section(servers[SERVER_NAME]) if _emittable(servers[SERVER_NAME]) else None
    return Merge(text, previous, changed=True)


def _emittable(value: Any) -> bool:
    try:
        toml_section(value)
    except (TypeError, AttributeError):
        return False
    return True


def _toml_refusal(path: Path, why: str) -> str:
    return (
        f"{path}: {why}. An existing 'loom' server defined as an inline table or with dotted keys "
        "cannot be replaced safely; remove it by hand, then run install again"
    )


# ---------------------------------------------------------------- writing


def backup_path(path: Path, now: datetime | None = None) -> Path:
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.loom-backup-{stamp}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.loom-backup-{stamp}-{n}")
        n += 1
    return candidate


def write_config(path: Path, text: str, private: bool) -> Path | None:
    """Back up the existing file, then replace it atomically. Returns the backup path."""
    backup = None
    if path.exists():
        backup = backup_path(path)
        shutil.copy2(path, backup)  # follows a symlinked config: the backup holds its content
    target = path.resolve() if path.is_symlink() else path  # keep a dotfiles symlink a symlink
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = target.stat().st_mode & 0o777 if target.exists() else (0o600 if private else None)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        else:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for secrets; this is not one
        # Atomic: a client reading the file (Claude Code rewrites ~/.claude.json often) never
        # sees half of it.
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return backup


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- skills


def packaged_skills() -> Traversable:
    return resources.files("loom_mcp") / SKILLS_PACKAGE_DIR


def _walk(node: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name.startswith(".") or child.name == "__pycache__":
            continue
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            yield from _walk(child, rel + "/")
        else:
            yield rel, child


def skill_files(root: Traversable | None = None) -> dict[str, dict[str, bytes]]:
    """{skill name: {relative path: content}} for every skill directory holding a SKILL.md."""
    root = root or packaged_skills()
    if not root.is_dir():
        raise InstallError(f"the packaged skills are missing ({root}); reinstall loom-mcp")
    skills = {}
    for child in sorted(root.iterdir(), key=lambda c: c.name):
        if child.is_dir() and (child / "SKILL.md").is_file():
            skills[child.name] = {rel: f.read_bytes() for rel, f in _walk(child)}
    return skills


def _tree(path: Path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
        and not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(path).parts
        )
    }


def install_skills(dest_root: Path, dry_run: bool) -> list[str]:
    notes = []
    for name, files in skill_files().items():
        dest = dest_root / name
        if dest.is_symlink():
            # Someone linked a checkout's skill here on purpose; not ours to replace.
            notes.append(f"skill {name}: {dest} is a symlink to {os.readlink(dest)}; left as is")
            continue
        if dest.is_dir() and _tree(dest) == files:
            notes.append(f"skill {name}: {dest} is up to date")
            continue
        verb = "replace" if dest.exists() else "copy"
        if dry_run:
            notes.append(f"skill {name}: would {verb} {dest}")
            continue
        dest_root.mkdir(parents=True, exist_ok=True)
        # Build beside it, then swap, so a client never reads half a skill; the staging names
        # start with a dot, which skill discovery skips.
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.new-", dir=dest_root))
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it 0700; skills are not private
        try:
            for rel, content in files.items():
                target = staging / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            if dest.exists():
                old = dest_root / f".{name}.old-{os.getpid()}-{time.monotonic_ns()}"
                os.replace(dest, old)
                os.replace(staging, dest)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(staging, dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        notes.append(
            f"skill {name}: replaced {dest} (its content differed)"
            if verb == "replace"
            else f"skill {name}: copied to {dest}"
        )
    return notes


# ---------------------------------------------------------------- the command


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
            new_text = toml_section(entry) if opts.client == "codex" else _pretty(entry)
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
        for note in install_skills(
            skills_dir(opts.client, opts.scope, project_dir, home), opts.dry_run
        ):
            say(note)

    if opts.client == "claude":
        shadow = _claude_local_shadow(home, project_dir)
        if shadow:
            say(shadow)
        if opts.scope == "project":
            say(
                "next: restart Claude Code in this project and approve the 'loom' server; check with /mcp"
            )
        else:
            say("next: restart Claude Code; check with /mcp or `claude mcp list`")
    elif opts.client == "cursor":
        say("next: reload Cursor (Settings > MCP shows 'loom' with its tools)")
    else:
        if opts.scope == "project":
            say(
                "note: Codex reads .codex/config.toml only in trusted projects; otherwise use --scope user"
            )
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
