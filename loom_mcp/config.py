"""Configuration: `LOOM_HOME/loom.toml` overlaid by environment variables.

The human sets these; no tool argument can change them (the gate's thresholds live here).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.judge_models import GateConfig
from loom_mcp.models import Budgets

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_FILE = "loom.toml"


class LoomConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    home: Path
    allowed_roots: list[Path] = Field(
        description="Repositories, tasks and candidates must live under one of these directories"
    )
    budgets: Budgets = Field(default_factory=Budgets)
    gate: GateConfig = Field(default_factory=GateConfig)
    job_timeout_s: float = Field(default=900.0, gt=0)
    warm_workers: bool = Field(
        default=True,
        description="Keep a trusted worker (the task's reference and input preparation) started "
        "ahead of the next call; each idle one holds an interpreter with torch imported",
    )
    lease_timeout_s: float = Field(default=900.0, gt=0)

    @property
    def ledger_path(self) -> Path:
        return self.home / "ledger.sqlite3"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    @property
    def jobs_dir(self) -> Path:
        return self.home / "jobs"

    @property
    def locks_dir(self) -> Path:
        return self.home / "locks"

    @property
    def cache_dir(self) -> Path:
        return self.home / "cache"

    def fingerprint(self) -> str:
        """Hash of everything that affects a verdict (not paths), recorded with each campaign."""
        material = self.model_dump_json(include={"budgets", "gate", "job_timeout_s"})
        return hashlib.sha256(material.encode()).hexdigest()[:16]

    def check_allowed(self, path: Path, what: str) -> Path:
        resolved = path.expanduser().resolve()
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


def load_config(home: Path | None = None, environ: dict[str, str] | None = None) -> LoomConfig:
    """Resolve home (argument > LOOM_HOME > platform state dir), read loom.toml, apply env overrides."""
    env = os.environ if environ is None else environ
    home = Path(home or env.get("LOOM_HOME") or default_home()).expanduser().resolve()
    data: dict = {}
    config_file = home / CONFIG_FILE
    if config_file.is_file():
        try:
            data = tomllib.loads(config_file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise LoomError(ErrorCode.BAD_INPUT, f"{config_file}: {exc}") from exc
    roots_env = env.get("LOOM_ALLOWED_ROOTS")
    if roots_env:
        data["allowed_roots"] = [p for p in roots_env.split(os.pathsep) if p]
    if "allowed_roots" not in data:
        # Sane default: the user's home and the directory the host started us in.
        data["allowed_roots"] = [str(Path.home()), os.getcwd()]
    data["allowed_roots"] = [Path(p).expanduser().resolve() for p in data["allowed_roots"]]
    data["home"] = home
    return LoomConfig.model_validate(data)
