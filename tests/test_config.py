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


def test_the_job_disk_quota_defaults_to_half_the_free_space_and_a_set_value_wins(tmp_path):
    """A fixed 16 GiB refused problems whose outputs alone are 20 GiB on a 64 GB disk: the
    default follows the disk LOOM_HOME is on (16 GiB at least); loom.toml's value is kept."""
    import shutil

    from loom_mcp.config import load_config

    home = tmp_path / "not-yet" / "home"  # created later: its nearest existing parent is measured
    default = load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}).job_disk_bytes
    free = shutil.disk_usage(tmp_path).free
    assert default >= 16 << 30
    assert abs(default - max(16 << 30, free // 2)) <= 1 << 30  # other writers move the free space
    set_home = tmp_path / "set"
    set_home.mkdir()
    (set_home / "loom.toml").write_text("job_disk_bytes = 1073741824\n")
    assert load_config(set_home, environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}).job_disk_bytes == 1 << 30
