"""Configuration: `LOOM_HOME/loom.toml` overlaid by environment variables.

The human sets these; no tool argument can change them (the gate's thresholds live here).
The file is read once, when the server starts. A change on disk while it runs is reported
(`LoomConfig.drift()`), never applied mid-campaign; a file that no longer loads is refused at
the next start with [CONFIG_INVALID], the file:line, and how to recover.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import GateConfig
from loom_mcp.models import Budgets

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_FILE = "loom.toml"
# A copy of the loom.toml the last server started with (cache/), to diff a file that broke.
LAST_STARTED = "loom.toml.last-start"


@dataclass(frozen=True)
class ConfigSource:
    """What the running server's rules were loaded from."""

    path: Path
    sha256: str | None  # None: there was no file (defaults)
    rules_fingerprint: str


def _three_quarters_of_ram() -> int:
    """job_memory_bytes' default: one job may use most of the machine's memory, not all of it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 3 // 4
    except (ValueError, OSError, AttributeError):
        return 16 << 30


class _InHome:
    """A fixed place inside LOOM_HOME, read as a path attribute of the config."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, config: LoomConfig, owner: type | None = None) -> Path:
        return config.home / self.name


class ExecutorConfig(BaseModel):
    """Where jobs run. Not part of the fingerprint: which free device of a kind runs a job
    changes no verdict."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["local", "ray"] = Field(
        default="local", description="local: this machine's devices; ray: a Ray cluster's (pip install 'loom-mcp[ray]')"
    )
    address: str = Field(
        default="local",
        description='kind = "ray": "local" (a private Ray instance here), "auto" (the cluster this '
        'machine is in) or "ray://host:port"',
    )
    max_jobs: int | None = Field(
        default=None, ge=1, description="Jobs at once; default one per GPU (cpu_slots without a GPU)"
    )
    cpu_slots: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Jobs at once on a machine without a GPU; above 1 CPU timings share the cores",
    )


class LoomConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", ignored_types=(_InHome,))
    home: Path
    allowed_roots: list[Path] = Field(
        description="Repositories, tasks and candidates must live under one of these directories"
    )
    budgets: Budgets = Field(default_factory=Budgets)
    gate: GateConfig = Field(default_factory=GateConfig)
    job_timeout_s: float = Field(default=900.0, gt=0)
    warm_workers: bool = Field(
        default=True,
        description="Keep workers started ahead of the next call: trusted ones (the task's "
        "reference, input preparation) and, on a GPU host, blank ones for candidates and the "
        "benchmark's processes (up to 3 + 6); each idle one holds an interpreter with torch "
        "imported (a few hundred MB of host memory)",
    )
    lease_timeout_s: float = Field(default=900.0, gt=0)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    # Sandbox limits per job (loom_mcp/sandbox/policy.py hands them to every JobSpec).
    job_memory_bytes: int = Field(
        default_factory=lambda: _three_quarters_of_ram(),
        gt=0,
        description="Memory of one job (cgroup memory.max, else RLIMIT_DATA); default 75% of RAM",
    )
    job_disk_bytes: int = Field(
        default=16 << 30,
        gt=0,
        description="What one job's directories may grow by (it is killed past it); also its /tmp size",
    )

    _source: ConfigSource | None = PrivateAttr(default=None)
    _seen: tuple[tuple | None, str | None] | None = PrivateAttr(default=None)

    # LOOM_HOME's layout.
    ledger_path = _InHome("ledger.sqlite3")
    artifacts_dir = _InHome("artifacts")
    jobs_dir = _InHome("jobs")
    locks_dir = _InHome("locks")
    cache_dir = _InHome("cache")

    def fingerprint(self) -> str:
        """Hash of everything that affects a verdict (not paths), recorded with each campaign."""
        material = self.model_dump_json(include={"budgets", "gate", "job_timeout_s"})
        return hashlib.sha256(material.encode()).hexdigest()[:16]

    @property
    def source(self) -> ConfigSource | None:
        return self._source

    @property
    def last_started_path(self) -> Path:
        return self.cache_dir / LAST_STARTED

    def drift(self) -> str | None:
        """A warning when loom.toml on disk is no longer the file this config was loaded from;
        None while it is the same (or this config did not come from load_config). The running
        server keeps its rules either way. Cheap: the file is re-read only when its stat changes."""
        source = self._source
        if source is None:
            return None
        try:
            st = source.path.stat()
            key: tuple | None = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            key = None
        except OSError:
            return None
        if self._seen is not None and self._seen[0] == key:
            return self._seen[1]
        try:
            digest = file_sha256(source.path) if key is not None else None
        except OSError:
            return None
        note = None
        if digest != source.sha256:
            if digest is None:
                now = "removed (the next start uses the defaults)"
                new_rules = default_rules_fingerprint()
            else:
                try:
                    new_rules = rules_fingerprint(read_config_file(source.path))
                    now = f"sha256 {digest[:12]}"
                except LoomError as exc:
                    new_rules = None
                    problem = getattr(exc, "detail", exc.message)
                    now = (
                        f"sha256 {digest[:12]}, which no longer loads: [{exc.code.value}] "
                        f"{problem}; the next start will refuse it"
                    )
            before = f"sha256 {source.sha256[:12]}" if source.sha256 else "absent"
            rules = (
                f"rules fingerprint {source.rules_fingerprint} -> {new_rules}"
                if new_rules and new_rules != source.rules_fingerprint
                else f"rules fingerprint still {source.rules_fingerprint}"
                if new_rules
                else f"rules fingerprint {source.rules_fingerprint} in force"
            )
            note = (
                f"loom.toml changed on disk since the server started ({source.path}: {before} -> "
                f"{now}; {rules}); the running server keeps the rules it started with; a human "
                "restarts it to apply the file"
            )
        self._seen = (key, note)
        return note

    def check_allowed(self, path: Path, what: str) -> Path:
        text = str(path)
        if "\0" in text:
            raise LoomError(ErrorCode.BAD_INPUT, f"{what} path contains a NUL byte")
        if len(text) > 4096 or any(len(part) > 255 for part in Path(text).parts):
            raise LoomError(
                ErrorCode.BAD_INPUT, f"{what} path is longer than the file system allows (4096 bytes, 255 a component)"
            )
        if not path.expanduser().is_absolute():
            # Against the server's working directory it would name some other file: refuse.
            raise LoomError(
                ErrorCode.BAD_INPUT,
                f"{what} {text[:300]!r} is a relative path; give an "
                "absolute path (tools that take campaign_id resolve relative paths against "
                "the campaign's repository)",
            )
        try:
            resolved = path.expanduser().resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop, an unreadable component
            raise LoomError(ErrorCode.BAD_INPUT, f"{what} {text}: cannot resolve ({exc})") from exc
        # The server's own state (frozen candidates, worktrees) is always readable by the server.
        for root in [*self.allowed_roots, self.home]:
            if resolved == root or root in resolved.parents:
                return resolved
        roots = ", ".join(str(r) for r in self.allowed_roots)
        raise LoomError(
            ErrorCode.NOT_ALLOWED,
            f"{what} {resolved} is outside the allowed roots ({roots}); "
            f"add its parent to allowed_roots in {self.home / CONFIG_FILE} or LOOM_ALLOWED_ROOTS",
        )


def default_home() -> Path:
    from platformdirs import user_state_path

    return user_state_path("loom-mcp", appauthor=False)


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def _recovery(config_file: Path) -> str:
    """How the human gets a server back: fix the file, or compare with the last one that worked."""
    last = config_file.parent / "cache" / LAST_STARTED
    hint = f"fix {config_file} and start again (`loom-mcp doctor` checks it without serving)"
    if last.is_file() and file_sha256(last) != file_sha256(config_file):
        hint += (
            f"; the last loom.toml a server started with is {last}: "
            f"`diff {shlex.quote(str(last))} {shlex.quote(str(config_file))}` shows what changed, "
            f"`cp {shlex.quote(str(last))} {shlex.quote(str(config_file))}` restores it"
        )
    return hint


def _line_of(text: str, key: str) -> int | None:
    """The first line that assigns `key` (or opens a table named `key`), for error messages."""
    pattern = re.compile(rf'^\s*(?:\[+\s*)?(?:[\w."-]+\.)?"?{re.escape(key)}"?\s*(?:=|\])')
    for number, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return number
    return None


def _invalid(detail: str, config_file: Path) -> LoomError:
    error = LoomError(ErrorCode.CONFIG_INVALID, f"{detail}; {_recovery(config_file)}")
    error.detail = detail  # type: ignore[attr-defined]  # the problem alone, without the hint
    return error


def read_config_file(config_file: Path) -> dict:
    """Parse loom.toml (CONFIG_INVALID with file:line when it does not parse, or when what it
    says does not validate). A missing file is {}."""
    try:
        raw = config_file.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise _invalid(f"{config_file}: cannot be read ({exc.strerror})", config_file) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise _invalid(f"{config_file}:{line}: not UTF-8 text (byte {exc.start})", config_file) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        where = re.search(r"\(at line (\d+), column (\d+)\)", message)
        if where:
            message = message[: where.start()].rstrip()
            location = f"{config_file}:{where.group(1)}:{where.group(2)}"
        elif getattr(exc, "lineno", None):
            location = f"{config_file}:{exc.lineno}:{getattr(exc, 'colno', 0)}"
        else:
            location = str(config_file)
        raise _invalid(f"{location}: not valid TOML ({message})", config_file) from exc
    try:
        _validate(data, config_file.parent)
    except ValidationError as exc:
        problems = []
        for error in exc.errors()[:5]:
            loc = [str(part) for part in error["loc"]]
            line_no = _line_of(text, loc[-1]) if loc else None
            place = f"{config_file}:{line_no}" if line_no else str(config_file)
            problems.append(f"{place}: {'.'.join(loc) or '(top level)'}: {error['msg']}")
        more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
        raise _invalid(f"{'; '.join(problems)}{more}", config_file) from exc
    return data


def _validate(data: dict, home: Path) -> LoomConfig:
    return LoomConfig.model_validate({"allowed_roots": [], **data, "home": home})


def rules_fingerprint(data: dict) -> str:
    """The fingerprint a config built from this parsed loom.toml would have."""
    return _validate({k: v for k, v in data.items() if k != "allowed_roots"}, Path("/")).fingerprint()


def default_rules_fingerprint() -> str:
    return rules_fingerprint({})


def resolve_home(home: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """argument > LOOM_HOME > platform state dir."""
    env = os.environ if environ is None else environ
    return Path(home or env.get("LOOM_HOME") or default_home()).expanduser().resolve()


def load_config(home: Path | None = None, environ: dict[str, str] | None = None) -> LoomConfig:
    """Resolve home (argument > LOOM_HOME > platform state dir), read loom.toml, apply env overrides."""
    env = os.environ if environ is None else environ
    home = resolve_home(home, env)
    config_file = home / CONFIG_FILE
    sha = file_sha256(config_file) if config_file.is_file() else None
    data: dict = read_config_file(config_file) if sha is not None else {}
    rules = rules_fingerprint(data)
    roots_env = env.get("LOOM_ALLOWED_ROOTS")
    if roots_env:
        data["allowed_roots"] = [p for p in roots_env.split(os.pathsep) if p]
    if "allowed_roots" not in data:
        # Sane default: the user's home and the directory the host started us in.
        data["allowed_roots"] = [str(Path.home()), os.getcwd()]
    data["allowed_roots"] = [Path(p).expanduser().resolve() for p in data["allowed_roots"]]
    data["home"] = home
    try:
        config = LoomConfig.model_validate(data)
    except ValidationError as exc:  # an override from the environment that does not validate
        raise LoomError(
            ErrorCode.CONFIG_INVALID,
            f"configuration from {config_file} and the environment does not validate: {exc.errors()[0]['msg']}",
        ) from exc
    config._source = ConfigSource(path=config_file, sha256=sha, rules_fingerprint=rules)
    return config
