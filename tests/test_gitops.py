"""gitops against real repositories: freezing, worktrees, compare-and-swap commits, crash cleanup.

Every test that calls into gitops also checks the user's checkout (HEAD, refs, index bytes,
`git status`, working-tree files) is byte-identical before and after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from loom_mcp import gitops
from loom_mcp.errors import ErrorCode, LoomError

BRANCH = "loom/c20250101-abcdef"
TRAILERS = {
    "Loom-Verdict": "accept",
    "Loom-Speedup": "1.23x [1.20, 1.26]",
    "Loom-Evidence": "v20250101-00000001, b20250101-00000002",
    "Loom-Device": "NVIDIA H200 (sm_90)",
}
_LOCAL_ENV = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_COMMON_DIR",
)


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_ENV}
    env["GIT_OPTIONAL_LOCKS"] = "0"  # our own `git status` must not refresh the index it checks
    res = subprocess.run(
        ["git", *args], cwd=cwd, env=env, input=input, capture_output=True, check=False
    )
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode("utf-8", "surrogateescape")


def snapshot(repo: Path) -> dict:
    """Everything of the user's checkout that gitops must never change."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(repo):
        if Path(dirpath) == repo:
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(repo).as_posix()
            if p.is_symlink():
                files[rel] = ("link", os.readlink(p))
            elif p.is_file():
                files[rel] = ("file", p.read_bytes(), os.access(p, os.X_OK))
            else:
                files[rel] = ("dir",)
    refs = git(repo, "for-each-ref", "--format=%(refname) %(objectname)")
    return {
        "HEAD": (repo / ".git" / "HEAD").read_bytes(),
        "head": git(repo, "rev-parse", "HEAD"),
        "refs": [r for r in refs.splitlines() if not r.startswith("refs/heads/loom/")],
        "index": hashlib.sha256((repo / ".git" / "index").read_bytes()).hexdigest(),
        "status": git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=all"),
        "files": files,
    }


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repo with a subdir, a space and non-ASCII in names, an executable, a .gitignore."""
    root = tmp_path / "user repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Ann User")
    git(root, "config", "user.email", "ann@example.com")
    (root / "kernel.py").write_text("def k():\n    return 1\n")
    (root / "gone.txt").write_text("to be deleted\n")
    (root / "dir with space").mkdir()
    (root / "dir with space" / "ünï.cu").write_text("// base\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("*.log\nbuild/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    return tmp_path / "worktrees"


def base_of(repo: Path) -> str:
    return git(repo, "rev-parse", "HEAD").strip()


def codes(exc: pytest.ExceptionInfo[LoomError]) -> ErrorCode:
    return exc.value.code


# ---------------------------------------------------------------------------------------- freeze


def test_freeze_auto_finds_modified_untracked_deleted(repo: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("def k():\n    return 2\n")
    (repo / "gone.txt").unlink()
    (repo / "dir with space" / "nëw file.py").write_text("x = 1\n")
    (repo / "debug.log").write_text("ignored\n")
    (repo / "link.py").symlink_to("kernel.py")
    before = snapshot(repo)

    change = gitops.freeze_change(repo, base, None)

    assert change.files == {
        "dir with space/nëw file.py": "x = 1\n",
        "gone.txt": None,
        "kernel.py": "def k():\n    return 2\n",
        "link.py": "kernel.py",
    }
    assert change.symlinks == ["link.py"] and change.binary == [] and change.executable == []
    assert change.base_commit == base
    assert "+    return 2" in change.patch and "deleted file mode" in change.patch
    assert len(change.digest) == 64
    assert gitops.freeze_change(repo, base, None).digest == change.digest
    assert snapshot(repo) == before


def test_freeze_explicit_paths(repo: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("changed\n")
    (repo / "dir with space" / "ünï.cu").write_text("// changed\n")
    (repo / "other.py").write_text("not listed\n")
    before = snapshot(repo)

    change = gitops.freeze_change(
        repo,
        base,
        [str(repo / "dir with space" / "ünï.cu"), "./kernel.py", "run.sh", "gone.txt"],
    )

    # Listed but unchanged paths are dropped; unlisted changes are not picked up.
    assert sorted(change.files) == ["dir with space/ünï.cu", "kernel.py"]
    assert snapshot(repo) == before


def test_freeze_is_a_snapshot_later_edits_do_not_leak(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_bytes(b"v1\r\nwith crlf\r\n")
    change = gitops.freeze_change(repo, base, ["kernel.py"])
    (repo / "kernel.py").write_text("v2 written after the freeze\n")
    before = snapshot(repo)

    wt = gitops.prepare_worktree(repo, roots, "s1", base, change)

    assert change.files["kernel.py"] == "v1\r\nwith crlf\r\n"
    assert (wt / "kernel.py").read_bytes() == b"v1\r\nwith crlf\r\n"
    assert snapshot(repo) == before


def test_freeze_binary_and_non_utf8_are_exact(repo: Path) -> None:
    base = base_of(repo)
    blob = bytes(range(256)) * 4
    (repo / "weights.bin").write_bytes(blob)
    (repo / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    change = gitops.freeze_change(repo, base, None)
    assert change.binary == ["latin1.txt", "weights.bin"]
    assert change.content_bytes("weights.bin") == blob
    assert change.content_bytes("latin1.txt") == b"caf\xe9\n"
    assert "GIT binary patch" in change.patch


def test_freeze_refuses_big_binary(repo: Path) -> None:
    base = base_of(repo)
    (repo / "big.bin").write_bytes(b"\0" * (gitops.MAX_BINARY_BYTES + 1))
    with pytest.raises(LoomError, match="binary") as exc:
        gitops.freeze_change(repo, base, None)
    assert codes(exc) == ErrorCode.BAD_INPUT


@pytest.mark.parametrize(
    "bad",
    ["../outside.txt", "OUTSIDE_ABS", ".git/config", "sub/../../outside.txt", "dir with space"],
)
def test_freeze_refuses_paths_outside_or_not_files(repo: Path, bad: str) -> None:
    (repo.parent / "outside.txt").write_text("secret\n")
    if bad == "OUTSIDE_ABS":
        bad = str(repo.parent / "outside.txt")
    before = snapshot(repo)
    with pytest.raises(LoomError) as exc:
        gitops.freeze_change(repo, base_of(repo), [bad])
    assert codes(exc) == ErrorCode.BAD_INPUT
    assert snapshot(repo) == before


def test_freeze_refuses_escaping_symlinks(repo: Path) -> None:
    base = base_of(repo)
    (repo.parent / "secret.txt").write_text("secret\n")
    (repo / "escape.txt").symlink_to(repo.parent / "secret.txt")
    with pytest.raises(LoomError, match="outside the repository") as exc:
        gitops.freeze_change(repo, base, None)
    assert codes(exc) == ErrorCode.BAD_INPUT
    (repo / "escape.txt").unlink()

    (repo.parent / "elsewhere").mkdir()
    (repo.parent / "elsewhere" / "x.py").write_text("x\n")
    (repo / "linkdir").symlink_to(repo.parent / "elsewhere")
    with pytest.raises(LoomError) as exc:
        gitops.freeze_change(repo, base, ["linkdir/x.py"])
    assert codes(exc) == ErrorCode.BAD_INPUT


def test_freeze_refuses_missing_and_ignored_explicit_paths(repo: Path) -> None:
    base = base_of(repo)
    with pytest.raises(LoomError, match="neither"):
        gitops.freeze_change(repo, base, ["nope.py"])
    (repo / "out.log").write_text("log\n")
    with pytest.raises(LoomError, match="ignored"):
        gitops.freeze_change(repo, base, ["out.log"])


def test_freeze_refuses_empty_change(repo: Path) -> None:
    base = base_of(repo)
    for paths in (None, [], ["kernel.py"]):
        with pytest.raises(LoomError, match="nothing to submit") as exc:
            gitops.freeze_change(repo, base, paths)
        assert codes(exc) == ErrorCode.BAD_INPUT
    # A touched file with the same bytes is not a change either.
    os.utime(repo / "kernel.py", (1, 1))
    (repo / "build").mkdir()
    (repo / "build" / "out.o").write_bytes(b"\0ignored")
    with pytest.raises(LoomError, match="nothing to submit"):
        gitops.freeze_change(repo, base, None)


# ------------------------------------------------------------------------------------- worktrees


def test_prepare_worktree_applies_exactly_the_change(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("def k():\n    return 3\n")
    (repo / "gone.txt").unlink()
    (repo / "dir with space" / "tool.sh").write_text("#!/bin/sh\n")
    (repo / "dir with space" / "tool.sh").chmod(0o755)
    (repo / "data.bin").write_bytes(b"\x00\xff\xfe")
    (repo / "alias.py").symlink_to("kernel.py")
    (repo / "unlisted.py").write_text("not part of the change\n")
    change = gitops.freeze_change(
        repo, base, ["kernel.py", "gone.txt", "dir with space/tool.sh", "data.bin", "alias.py"]
    )
    before = snapshot(repo)

    wt = gitops.prepare_worktree(repo, roots, "s20250101-0001", base, change)

    assert wt == roots.resolve() / "s20250101-0001"
    assert git(wt, "rev-parse", "HEAD").strip() == base
    assert (wt / "kernel.py").read_bytes() == b"def k():\n    return 3\n"
    assert not (wt / "gone.txt").exists()
    assert os.access(wt / "dir with space" / "tool.sh", os.X_OK)
    assert (wt / "data.bin").read_bytes() == b"\x00\xff\xfe"
    assert os.readlink(wt / "alias.py") == "kernel.py"
    assert not (wt / "unlisted.py").exists()
    assert (wt / "dir with space" / "ünï.cu").read_text() == "// base\n"
    staged = git(wt, "diff", "--cached", "--name-only", "-z").split("\0")
    assert sorted(filter(None, staged)) == sorted(change.files)
    assert git(wt, "status", "--porcelain", "--untracked-files=all").count("??") == 0
    assert snapshot(repo) == before


def test_file_and_directory_swaps(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "gone.txt").unlink()
    (repo / "gone.txt").mkdir()
    (repo / "gone.txt" / "inner.py").write_text("inner\n")
    shutil.rmtree(repo / "dir with space")
    (repo / "dir with space").write_text("now a file\n")
    before = snapshot(repo)
    change = gitops.freeze_change(repo, base, None)
    assert change.files == {
        "dir with space": "now a file\n",
        "dir with space/ünï.cu": None,
        "gone.txt": None,
        "gone.txt/inner.py": "inner\n",
    }
    wt = gitops.prepare_worktree(repo, roots, "s1", base, change)
    assert (wt / "gone.txt" / "inner.py").read_text() == "inner\n"
    assert (wt / "dir with space").read_text() == "now a file\n"
    sha = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: swap", TRAILERS)
    assert sorted(git(repo, "ls-tree", "-r", "--name-only", "-z", sha).split("\0")) == sorted(
        ["", ".gitignore", "dir with space", "gone.txt/inner.py", "kernel.py", "run.sh"]
    )
    assert snapshot(repo) == before


def test_prepare_worktree_refusals(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("new\n")
    change = gitops.freeze_change(repo, base, None)
    before = snapshot(repo)
    with pytest.raises(LoomError, match="outside the repository"):
        gitops.prepare_worktree(repo, repo / "wts", "s1", base, change)
    with pytest.raises(LoomError, match="submission id"):
        gitops.prepare_worktree(repo, roots, "../escape", base, change)
    gitops.prepare_worktree(repo, roots, "s1", base, change)
    with pytest.raises(LoomError, match="already exists"):
        gitops.prepare_worktree(repo, roots, "s1", base, change)
    assert snapshot(repo) == before


def test_commit_creates_branch_then_stacks_with_trailers(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    first = gitops.freeze_change(repo, base, None)
    before = snapshot(repo)

    assert gitops.campaign_tip(repo, BRANCH, base) == base
    wt1 = gitops.prepare_worktree(repo, roots, "s1", base, first)
    (wt1 / "__pycache__").mkdir()  # judging leaves build outputs behind: not committed
    (wt1 / "__pycache__" / "kernel.pyc").write_bytes(b"junk")
    (wt1 / "kernel.py").write_text("rewritten while judging\n")  # nor is a rewrite
    c1 = gitops.commit_accepted(repo, wt1, BRANCH, base, "loom: kernel x1.23\n\nbody", TRAILERS)
    gitops.remove_worktree(repo, wt1)
    assert snapshot(repo) == before
    assert gitops.campaign_tip(repo, BRANCH, base) == c1
    assert git(repo, "show", f"{c1}:kernel.py") == "v1\n"
    assert git(repo, "ls-tree", "-r", "--name-only", c1).count("__pycache__") == 0

    # The agent keeps editing its tree; a freeze vs base carries the earlier change too.
    (repo / "run.sh").write_text("#!/bin/sh\necho faster\n")
    before = snapshot(repo)
    second = gitops.freeze_change(repo, base, None)
    assert sorted(second.files) == ["kernel.py", "run.sh"]
    wt2 = gitops.prepare_worktree(repo, roots, "s2", c1, second)
    c2 = gitops.commit_accepted(
        repo, wt2, f"refs/heads/{BRANCH}", c1, "loom: run x1.10", {"Loom-Verdict": "accept"}
    )
    gitops.remove_worktree(repo, wt2)

    assert git(repo, "rev-list", "--parents", f"{base}..{BRANCH}").split() == [c2, c1, c1, base]
    assert git(repo, "show", "-s", "--format=%P", c2).strip() == c1
    assert gitops.commit_trailers(repo, c1) == TRAILERS
    assert gitops.commit_trailers(repo, c2) == {"Loom-Verdict": "accept"}
    assert gitops.commit_trailers(repo, base) == {}
    ident = git(repo, "show", "-s", "--format=%an <%ae>|%cn <%ce>|%B", c1)
    assert ident.startswith(
        "Ann User <ann@example.com>|loom-mcp <loom@localhost>|loom: kernel x1.23"
    )
    assert os.access(roots, os.F_OK) and not any(roots.iterdir())
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    assert snapshot(repo) == before


def test_prepare_refuses_change_already_on_the_branch(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    change = gitops.freeze_change(repo, base, None)
    wt = gitops.prepare_worktree(repo, roots, "s1", base, change)
    tip = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    gitops.remove_worktree(repo, wt)
    with pytest.raises(LoomError, match="already contained") as exc:
        gitops.prepare_worktree(repo, roots, "s2", tip, change)
    assert codes(exc) == ErrorCode.BAD_INPUT
    assert not (roots / "s2").exists()
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def test_commit_author_falls_back_to_loom_without_user_identity(
    repo: Path, roots: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    git(repo, "config", "--unset", "user.name")
    git(repo, "config", "--unset", "user.email")
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    wt = gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    sha = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    assert git(repo, "show", "-s", "--format=%an <%ae>|%cn", sha).strip() == (
        "loom-mcp <loom@localhost>|loom-mcp"
    )


def test_commit_refuses_wrong_tip_and_bad_input(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    change = gitops.freeze_change(repo, base, None)
    wt = gitops.prepare_worktree(repo, roots, "s1", base, change)
    before = snapshot(repo)
    # Someone else's commit is on the branch: the expected tip (= start) no longer matches.
    other = git(repo, "commit-tree", f"{base}^{{tree}}", "-p", base, "-m", "elsewhere").strip()
    git(repo, "update-ref", f"refs/heads/{BRANCH}", other)
    with pytest.raises(gitops.BranchMoved) as exc:
        gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    assert codes(exc) == ErrorCode.INTERNAL and exc.value.actual == other
    with pytest.raises(gitops.BranchMoved, match="prepared and judged on"):
        gitops.commit_accepted(repo, wt, BRANCH, other, "loom: v1", TRAILERS)
    assert git(repo, "rev-parse", BRANCH).strip() == other
    git(repo, "update-ref", "-d", f"refs/heads/{BRANCH}")

    with pytest.raises(LoomError, match="trailer key"):
        gitops.commit_accepted(repo, wt, BRANCH, base, "m", {"Bad Key": "x"})
    with pytest.raises(LoomError, match="one-line"):
        gitops.commit_accepted(repo, wt, BRANCH, base, "m", {"Loom-Verdict": "a\nb"})
    with pytest.raises(LoomError, match="message"):
        gitops.commit_accepted(repo, wt, BRANCH, base, "  \n", TRAILERS)
    with pytest.raises(LoomError, match="not a valid branch"):
        gitops.commit_accepted(repo, wt, "bad..name", base, "m", TRAILERS)
    with pytest.raises(LoomError, match="not a linked worktree"):
        gitops.commit_accepted(repo, repo, BRANCH, base, "m", TRAILERS)
    assert snapshot(repo) == before


def test_commit_cas_fails_cleanly_when_ref_is_locked(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    wt = gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    lock = repo / ".git" / "refs" / "heads" / (BRANCH + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")  # another writer is mid-update
    with pytest.raises(gitops.BranchMoved, match="compare-and-swap"):
        gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    lock.unlink()
    assert gitops.campaign_tip(repo, BRANCH, base) == base  # branch still absent
    sha = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)  # retry works
    assert gitops.campaign_tip(repo, BRANCH, base) == sha


def test_racing_commits_with_same_expected_tip_one_wins(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    before = None
    for round_ in range(3):
        tip = gitops.campaign_tip(repo, BRANCH, base)
        worktrees = []
        for i in range(2):
            (repo / f"r{round_}_{i}.py").write_text(f"{round_} {i}\n")
            change = gitops.freeze_change(repo, base, [f"r{round_}_{i}.py"])
            worktrees.append(gitops.prepare_worktree(repo, roots, f"s{round_}-{i}", tip, change))
        before = snapshot(repo)
        barrier = threading.Barrier(2)
        results: list[str | LoomError] = [None, None]  # type: ignore[list-item]

        def accept(i: int, wt: Path, tip: str = tip, barrier=barrier, results=results) -> None:
            barrier.wait()
            try:
                results[i] = gitops.commit_accepted(repo, wt, BRANCH, tip, f"loom: {i}", TRAILERS)
            except LoomError as exc:
                results[i] = exc

        threads = [threading.Thread(target=accept, args=(i, wt)) for i, wt in enumerate(worktrees)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [r for r in results if isinstance(r, str)]
        losers = [r for r in results if isinstance(r, LoomError)]
        assert len(winners) == 1 and len(losers) == 1
        assert losers[0].code == ErrorCode.INTERNAL
        assert git(repo, "rev-parse", BRANCH).strip() == winners[0]
        assert git(repo, "show", "-s", "--format=%P", winners[0]).strip() == tip
        for wt in worktrees:
            gitops.remove_worktree(repo, wt)
        assert snapshot(repo) == before
    assert len(git(repo, "rev-list", f"{base}..{BRANCH}").split()) == 3


def test_serialized_threads_build_a_linear_history(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    lock = threading.Lock()
    errors: list[BaseException] = []
    for i in range(4):
        (repo / f"k{i}.py").write_text(f"k = {i}\n")
    before = snapshot(repo)

    def submit(i: int) -> None:
        try:
            change = gitops.freeze_change(repo, base, [f"k{i}.py"])
            with lock:  # what the submission service's per-campaign lock does
                tip = gitops.campaign_tip(repo, BRANCH, base)
                wt = gitops.prepare_worktree(repo, roots, f"s{i}", tip, change)
                gitops.commit_accepted(repo, wt, BRANCH, tip, f"loom: k{i}", TRAILERS)
                gitops.remove_worktree(repo, wt)
        except BaseException as exc:  # surfaced below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    history = git(repo, "rev-list", "--parents", f"{base}..{BRANCH}").splitlines()
    assert len(history) == 4 and all(len(line.split()) == 2 for line in history)
    tree = git(repo, "ls-tree", "--name-only", BRANCH).split()
    assert {f"k{i}.py" for i in range(4)} <= set(tree)
    assert snapshot(repo) == before


def test_detached_head_repo_works_and_stays_detached(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    git(repo, "checkout", "-q", "--detach", base)
    (repo / "kernel.py").write_text("v1\n")
    before = snapshot(repo)
    change = gitops.freeze_change(repo, base, None)
    wt = gitops.prepare_worktree(repo, roots, "s1", base, change)
    sha = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    gitops.remove_worktree(repo, wt)
    assert git(repo, "rev-parse", BRANCH).strip() == sha
    assert (repo / ".git" / "HEAD").read_text().strip() == base
    assert snapshot(repo) == before


def test_leaked_git_environment_is_ignored(
    repo: Path, roots: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As inside a git hook: these would otherwise point every command at another repo / index.
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(tmp_path / "bogus-index"))
    monkeypatch.setenv("GIT_WORK_TREE", str(tmp_path))
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    before = snapshot(repo)
    wt = gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    gitops.commit_accepted(repo, wt, BRANCH, base, "loom: v1", TRAILERS)
    assert not (tmp_path / "bogus-index").exists()
    assert snapshot(repo) == before


# --------------------------------------------------------------------------------------- cleanup


def test_remove_worktree(repo: Path, roots: Path, tmp_path: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    wt = gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    (wt / "build.o").write_bytes(b"untracked output")
    before = snapshot(repo)
    with pytest.raises(LoomError, match="repository itself"):
        gitops.remove_worktree(repo, repo)
    stranger = tmp_path / "not-a-worktree"
    stranger.mkdir()
    with pytest.raises(LoomError, match="refusing"):
        gitops.remove_worktree(repo, stranger)
    assert stranger.is_dir()
    gitops.remove_worktree(repo, wt)
    assert not wt.exists()
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    gitops.remove_worktree(repo, wt)  # already gone: nothing to do
    assert snapshot(repo) == before


def test_cleanup_after_crash(repo: Path, roots: Path, tmp_path: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    change = gitops.freeze_change(repo, base, None)
    for sid in ("s-keep", "s-crash", "s-vanished", "s-orphan"):
        gitops.prepare_worktree(repo, roots, sid, base, change)
    (roots / "s-keep.task.py").write_text("task of a live submission\n")
    (roots / "s-crash.task.py").write_text("task of a dead one\n")
    # Metadata whose directory vanished, and a directory whose metadata vanished.
    shutil.rmtree(roots / "s-vanished")
    admin = Path(
        git(roots / "s-orphan", "rev-parse", "--path-format=absolute", "--git-dir").strip()
    )
    shutil.rmtree(admin)
    (roots / "junk").mkdir()
    (roots / "junk" / "half-written").write_text("x")
    # The user's own worktree elsewhere, currently missing (an unmounted disk), is not ours to prune.
    git(repo, "worktree", "add", "-q", "--detach", str(tmp_path / "user-wt"), base)
    shutil.rmtree(tmp_path / "user-wt")
    # Another repository's worktree under the same root is not ours either.
    other = tmp_path / "other repo"
    other.mkdir()
    git(other, "init", "-q", "-b", "main")
    git(
        other,
        "-c",
        "user.name=x",
        "-c",
        "user.email=x@x",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        "i",
    )
    git(other, "worktree", "add", "-q", "--detach", str(roots / "foreign"))
    before = snapshot(repo)

    removed = gitops.cleanup_stale_worktrees(repo, roots, keep={"s-keep"})

    assert removed == ["junk", "s-crash", "s-crash.task.py", "s-orphan", "s-vanished"]
    assert sorted(p.name for p in roots.iterdir()) == ["foreign", "s-keep", "s-keep.task.py"]
    listed = git(repo, "worktree", "list", "--porcelain")
    assert str(roots.resolve() / "s-keep") in listed and "user-wt" in listed
    assert "s-crash" not in listed and "s-vanished" not in listed
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 3
    assert "foreign" in git(other, "worktree", "list")
    assert gitops.cleanup_stale_worktrees(repo, roots, keep={"s-keep"}) == []
    assert gitops.cleanup_stale_worktrees(repo, roots) == ["s-keep", "s-keep.task.py"]
    assert snapshot(repo) == before


def test_cleanup_when_the_repo_is_gone(repo: Path, roots: Path) -> None:
    base = base_of(repo)
    (repo / "kernel.py").write_text("v1\n")
    gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    shutil.rmtree(repo)
    assert gitops.cleanup_stale_worktrees(repo, roots) == ["s1"]
    assert not any(roots.iterdir())


# --------------------------------------------------------------------------------------- reports


def test_format_patch_applies_with_git_am_on_a_fresh_clone(
    repo: Path, roots: Path, tmp_path: Path
) -> None:
    base = base_of(repo)
    assert gitops.format_patch(repo, base, BRANCH) == ""
    (repo / "kernel.py").write_text("v1 ünïcode\n")
    (repo / "gone.txt").unlink()
    (repo / "dir with space" / "blob.bin").write_bytes(bytes(range(256)))
    (repo / "tool.sh").write_text("#!/bin/sh\n")
    (repo / "tool.sh").chmod(0o755)
    wt = gitops.prepare_worktree(repo, roots, "s1", base, gitops.freeze_change(repo, base, None))
    c1 = gitops.commit_accepted(repo, wt, BRANCH, base, "loom: one\n\nfirst", TRAILERS)
    (repo / "kernel.py").write_text("v2\n")
    wt = gitops.prepare_worktree(repo, roots, "s2", c1, gitops.freeze_change(repo, base, None))
    c2 = gitops.commit_accepted(repo, wt, BRANCH, c1, "loom: two", TRAILERS)
    before = snapshot(repo)

    patch = gitops.format_patch(repo, base, BRANCH)

    assert patch.count("\nSubject: [PATCH") == 2 and "GIT binary patch" in patch
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    git(clone, "checkout", "-q", "--detach", base)
    git(clone, "-c", "user.name=r", "-c", "user.email=r@r", "am", "-q", input=patch.encode())
    assert git(clone, "rev-parse", "HEAD^{tree}") == git(repo, "rev-parse", f"{c2}^{{tree}}")
    assert gitops.commit_trailers(clone, "HEAD") == TRAILERS
    assert snapshot(repo) == before
