"""Where each MCP client reads loom's registration, what the entry holds, and merging it in.

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

The command is the absolute path of this installation's `loom-mcp`, so the client does not
depend on the user's shell PATH (GUI-launched editors often have a different one).

Existing configs are merged, never clobbered: other servers and keys are kept, an existing
`loom` entry is replaced, and an unreadable config is refused untouched. TOML goes through
`tomlkit`, which keeps the user's comments, ordering and other tables; the result is re-parsed
and compared with the original before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import tomlkit
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import AoT, Comment, InlineTable, Item, Table, Whitespace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SERVER_NAME = "loom"
CLIENTS = ("claude", "cursor", "codex")
SCOPES = ("project", "user")

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
TOML_COMMENT = "loom-mcp GPU optimization server; `loom-mcp install --client codex` rewrites this table"


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
    return pretty_json({"mcpServers": {SERVER_NAME: entry}})


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def _toml_value(value: Any) -> Item:
    # Tables nested in the entry stay inline, so the entry is one [mcp_servers.loom] table.
    if isinstance(value, dict):
        table = tomlkit.inline_table()
        for key, item in value.items():
            table.append(key, _toml_value(item))
        return table
    if isinstance(value, list):
        array = tomlkit.array()
        array.extend(_toml_value(item) for item in value)
        return array.multiline(len(array.as_string()) > 72)
    return tomlkit.item(value)


def toml_table(entry: dict[str, Any]) -> Table:
    table = tomlkit.table()
    table.add(tomlkit.comment(TOML_COMMENT))
    for key, value in entry.items():
        table.append(key, _toml_value(value))
    return table


def toml_section(entry: dict[str, Any]) -> str:
    """`[mcp_servers.loom]` with the entry, as a standalone document."""
    servers = tomlkit.table(is_super_table=True)
    servers.append(SERVER_NAME, toml_table(entry))
    doc = tomlkit.document()
    doc.append("mcp_servers", servers)
    return tomlkit.dumps(doc)


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
        return Merge(old_text or "", pretty_json(previous), changed=False)
    servers[SERVER_NAME] = entry  # an existing key keeps its position; a new one goes last
    indent = _json_indent(old_text) if old_text else 2
    trailing = "\n" if old_text is None or old_text.endswith("\n") or not old_text.strip() else ""
    text = json.dumps(data, indent=indent, ensure_ascii=False) + trailing
    return Merge(text, pretty_json(previous) if previous is not None else None, changed=True)


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


def _loom_parts(body: list[tuple[Any, Item]], depth: int = 0, dotted: bool = False) -> list[tuple[Item, bool]]:
    """Every place the document defines mcp_servers.loom: (item, reached through dotted keys)."""
    want = ("mcp_servers", SERVER_NAME)[depth]
    parts: list[tuple[Item, bool]] = []
    for key, item in body:
        if key is None or key.key != want:
            continue
        through_dots = dotted or key.is_dotted()
        if depth == 1:
            parts.append((item, through_dots))
        elif isinstance(item, (Table, InlineTable)):
            parts += _loom_parts(item.value.body, 1, through_dots)
    return parts


def _take_tail(table: Table) -> list[Comment | Whitespace]:
    """Remove and return the blank and comment lines that end a table's text.

    They sit before whatever follows the table (the next header's own comment, a blank line
    between tables), so they stay when the table is replaced.
    """
    body = table.value.body
    while body and isinstance(body[-1][1], (Table, AoT)):
        last = body[-1][1]
        if isinstance(last, AoT):
            if not last.body:
                break
            last = last.body[-1]
        body = last.value.body
    tail: list[Comment | Whitespace] = []
    while body and body[-1][0] is None:
        item = body[-1][1]
        if not isinstance(item, (Whitespace, Comment)):
            break
        tail.insert(0, item)
        body.pop()
    return tail


def merge_toml(path: Path, old_text: str | None, entry: dict[str, Any]) -> Merge:
    old_text = old_text or ""
    try:
        before = tomllib.loads(old_text)
        doc = tomlkit.parse(old_text)
    except (tomllib.TOMLDecodeError, TOMLKitError) as exc:
        raise InstallError(f"{path} is not valid TOML ({exc}); fix it, then run install again") from exc
    servers = before.get("mcp_servers", {})
    if not isinstance(servers, dict):
        raise InstallError(f"{path}: 'mcp_servers' is not a table")
    section = toml_section(entry)
    wanted = tomllib.loads(section)["mcp_servers"][SERVER_NAME]
    old_entry = servers.get(SERVER_NAME)
    previous = toml_section(old_entry) if isinstance(old_entry, dict) else None
    if old_entry == wanted:
        return Merge(old_text, section, changed=False)

    parts = _loom_parts(doc.body)
    if not parts:
        # Appended as its own table at the end: nothing the user wrote moves.
        text = old_text
        if text and not text.endswith("\n"):
            text += "\n"
        if text.strip() and not text.endswith("\n\n"):
            text += "\n"
        text += section
    else:
        old, dotted = parts[0]
        if len(parts) > 1 or dotted or not isinstance(old, Table):
            raise InstallError(_toml_refusal(path, "its 'loom' server cannot be replaced in place"))
        table = toml_table(entry)
        for item in _take_tail(old):
            table.add(item)
        try:
            doc["mcp_servers"][SERVER_NAME] = table  # in place: what surrounds it stays as it was
            text = tomlkit.dumps(doc)
        except (TOMLKitError, ValueError, KeyError, TypeError) as exc:
            raise InstallError(_toml_refusal(path, f"the merge failed ({exc})")) from exc

    # Only trusted once the result parses to the old document minus loom's entry, plus exactly
    # the new entry.
    try:
        after = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InstallError(_toml_refusal(path, f"the merged file would not parse ({exc})")) from exc
    got = after.get("mcp_servers", {}).get(SERVER_NAME)
    if got != wanted or _without_loom(after) != _without_loom(before):
        raise InstallError(_toml_refusal(path, "the merge would change more than the loom entry"))
    return Merge(text, previous, changed=True)


def _toml_refusal(path: Path, why: str) -> str:
    return (
        f"{path}: {why}. An existing 'loom' server defined as an inline table, with dotted keys "
        "or in tables apart from each other is not replaced automatically; remove it by hand, "
        "then run install again"
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
            os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600 is for secrets; this is not one
        # Atomic: a client reading the file (Claude Code rewrites ~/.claude.json often) never
        # sees half of it.
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return backup


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
