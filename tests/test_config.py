from __future__ import annotations

import pytest

from loom_mcp.config import load_config
from loom_mcp.errors import LoomError


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

