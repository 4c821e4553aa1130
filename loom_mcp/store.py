"""The ledger (SQLite, WAL) and the content-addressed artifact store under LOOM_HOME.

Every tool call is written when it starts and again when it ends, each in its own
transaction, so a `kill -9` at any moment leaves every answered call intact and the
unfinished one marked `running` until the next open turns it into `interrupted`.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel

from loom_mcp.errors import ErrorCode, LoomError

# Each entry upgrades the schema by one version; never edit an entry once released.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE campaigns (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        repo TEXT NOT NULL,
        goal TEXT NOT NULL,
        task TEXT,
        base_commit TEXT NOT NULL,
        base_branch TEXT,
        branch TEXT NOT NULL,
        config_fingerprint TEXT NOT NULL,
        budgets_json TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'active'
    );
    CREATE TABLE calls (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        tool TEXT NOT NULL,
        args_hash TEXT NOT NULL,
        campaign_id TEXT,
        started_at REAL NOT NULL,
        finished_at REAL,
        outcome TEXT NOT NULL,          -- running | ok | error | cancelled | interrupted
        error_code TEXT,
        wall_s REAL,
        device_s REAL NOT NULL DEFAULT 0,
        pid INTEGER NOT NULL,
        result_ref TEXT
    );
    CREATE INDEX calls_campaign ON calls(campaign_id, tool);
    CREATE TABLE artifacts (
        sha256 TEXT PRIMARY KEY,
        size INTEGER NOT NULL,
        kind TEXT NOT NULL,
        name TEXT,
        created_at REAL NOT NULL
    );
    """,
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,              -- validation | benchmark | compile | trace_analysis
        campaign_id TEXT,
        created_at REAL NOT NULL,
        record_sha TEXT NOT NULL,        -- the full JSON record in the artifact store
        summary_json TEXT NOT NULL
    );
    CREATE INDEX runs_kind ON runs(kind, created_at);
    """,
    """
    CREATE TABLE submissions (
        id TEXT PRIMARY KEY,
        campaign_id TEXT NOT NULL REFERENCES campaigns(id),
        created_at REAL NOT NULL,
        finished_at REAL,
        status TEXT NOT NULL,            -- running | accept | reject | needs_review | interrupted | error
        task TEXT NOT NULL,
        task_sha TEXT NOT NULL,
        candidate TEXT NOT NULL,
        candidate_sha TEXT NOT NULL,
        validation_id TEXT,
        benchmark_id TEXT,
        verdict_json TEXT,               -- the gate's Verdict
        commit_sha TEXT,
        worktree TEXT,
        pid INTEGER NOT NULL
    );
    CREATE INDEX submissions_campaign ON submissions(campaign_id, created_at);
    """,
    """
    ALTER TABLE runs ADD COLUMN reuse_key TEXT;  -- what the evidence depends on, hashed
    CREATE INDEX runs_reuse ON runs(kind, reuse_key);
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)


def args_hash(arguments: dict[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS, default=str)).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CallRow(BaseModel):
    id: int
    tool: str
    args_hash: str
    campaign_id: str | None
    started_at: float
    finished_at: float | None
    outcome: str
    error_code: str | None
    wall_s: float | None
    device_s: float
    pid: int
    result_ref: str | None


class Ledger:
    """Thread-safe wrapper over one SQLite connection. Writes are tiny and synchronous (≈ms)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed call survives power loss, not only a process kill.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()
        self.interrupted_on_open = self._mark_interrupted()

    # -- schema
    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise LoomError(
                        ErrorCode.INTERNAL,
                        f"ledger {self.path} has schema v{version}, newer than this loom-mcp "
                        f"(v{SCHEMA_VERSION}); upgrade loom-mcp",
                    )
                for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                    for statement in script.split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={number}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _mark_interrupted(self) -> int:
        """Calls left `running` by a process that no longer exists were interrupted (crash, kill -9)."""
        with self._lock:
            rows = self._db.execute("SELECT id, pid FROM calls WHERE outcome='running'").fetchall()
            dead = [r["id"] for r in rows if r["pid"] != os.getpid() and not _pid_alive(r["pid"])]
            for call_id in dead:
                self._db.execute(
                    "UPDATE calls SET outcome='interrupted', error_code='INTERRUPTED' WHERE id=?",
                    (call_id,),
                )
            return len(dead)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- calls
    def begin_call(self, tool: str, arguments: dict[str, Any], campaign_id: str | None = None) -> int:
        with self.transaction() as db:
            cur = db.execute(
                "INSERT INTO calls(tool, args_hash, campaign_id, started_at, outcome, pid)"
                " VALUES (?,?,?,?, 'running', ?)",
                (tool, args_hash(arguments), campaign_id, time.time(), os.getpid()),
            )
            return int(cur.lastrowid)

    def end_call(
        self,
        call_id: int,
        outcome: str,
        *,
        error_code: str | None = None,
        device_s: float = 0.0,
        result_ref: str | None = None,
        campaign_id: str | None = None,
    ) -> None:
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "UPDATE calls SET finished_at=?, outcome=?, error_code=?, wall_s=?-started_at,"
                " device_s=?, result_ref=?, campaign_id=COALESCE(?, campaign_id) WHERE id=?",
                (now, outcome, error_code, now, device_s, result_ref, campaign_id, call_id),
            )

    def calls(self, tool: str | None = None, campaign_id: str | None = None) -> list[CallRow]:
        sql, params = "SELECT * FROM calls WHERE 1=1", []
        if tool:
            sql += " AND tool=?"
            params.append(tool)
        if campaign_id:
            sql += " AND campaign_id=?"
            params.append(campaign_id)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY id", params).fetchall()
        return [CallRow(**dict(r)) for r in rows]

    # -- campaigns
    def insert_campaign(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.transaction() as db:
            db.execute(f"INSERT INTO campaigns({cols}) VALUES ({marks})", tuple(row.values()))

    def campaign(self, campaign_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM campaigns WHERE id=?", (campaign_id,)).fetchone()
        return dict(row) if row else None

    # -- runs (full records live in the artifact store; the ledger keeps the index)
    def insert_run(self, run_id: str, kind: str, record_sha: str, summary: dict[str, Any],
                   campaign_id: str | None = None, reuse_key: str | None = None) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO runs(id, kind, campaign_id, created_at, record_sha, summary_json, reuse_key)"
                " VALUES (?,?,?,?,?,?,?)",
                (run_id, kind, campaign_id, time.time(), record_sha, orjson.dumps(summary).decode(),
                 reuse_key),
            )

    def runs_with_key(self, kind: str, reuse_key: str) -> list[dict[str, Any]]:
        """Every run of `kind` whose evidence was computed from exactly the same inputs, newest
        first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM runs WHERE kind=? AND reuse_key=? ORDER BY created_at DESC",
                (kind, reuse_key)).fetchall()
        return [dict(r) for r in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs_of(self, campaign_id: str, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM runs WHERE campaign_id=? AND kind=? ORDER BY created_at",
                                    (campaign_id, kind)).fetchall()
        return [dict(r) for r in rows]

    # -- submissions
    def insert_submission(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.transaction() as db:
            db.execute(f"INSERT INTO submissions({cols}) VALUES ({marks})", tuple(row.values()))

    SUBMISSION_FIELDS = frozenset({"status", "finished_at", "validation_id", "benchmark_id",
                                   "verdict_json", "commit_sha", "worktree"})

    def update_submission(self, submission_id: str, **fields: Any) -> None:
        unknown = set(fields) - self.SUBMISSION_FIELDS
        if unknown:
            raise ValueError(f"not submission fields: {sorted(unknown)}")
        sets = ", ".join(f"{k}=?" for k in fields)
        with self.transaction() as db:
            db.execute(f"UPDATE submissions SET {sets} WHERE id=?", (*fields.values(), submission_id))

    def submissions(self, campaign_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM submissions WHERE campaign_id=? ORDER BY created_at", (campaign_id,)
            ).fetchall()
        return [dict(r) for r in rows]

    def interrupted_submissions(self) -> list[dict[str, Any]]:
        """Submissions left `running` by a dead process become `interrupted`; returns every
        interrupted one that still names a worktree (to be removed)."""
        with self.transaction() as db:
            rows = db.execute("SELECT id, pid FROM submissions WHERE status='running'").fetchall()
            for row in rows:
                if row["pid"] != os.getpid() and not _pid_alive(row["pid"]):
                    db.execute("UPDATE submissions SET status='interrupted' WHERE id=?", (row["id"],))
            found = db.execute(
                "SELECT * FROM submissions WHERE status='interrupted' AND worktree IS NOT NULL"
            ).fetchall()
        return [dict(r) for r in found]

    def live_submissions(self, campaign_id: str) -> set[str]:
        """Ids of submissions still running in a live process (their worktree dirs carry the id)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, pid FROM submissions WHERE campaign_id=? AND status='running'",
                (campaign_id,)).fetchall()
        return {r["id"] for r in rows if r["pid"] == os.getpid() or _pid_alive(r["pid"])}

    def clear_worktree(self, submission_id: str) -> None:
        self.update_submission(submission_id, worktree=None)

    # -- artifacts
    def record_artifact(self, sha256: str, size: int, kind: str, name: str | None) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO artifacts(sha256, size, kind, name, created_at)"
                " VALUES (?,?,?,?,?)",
                (sha256, size, kind, name, time.time()),
            )


def new_run_id(kind: str) -> str:
    import secrets

    prefix = {"validation": "v", "benchmark": "b", "compile": "k", "trace": "t", "submission": "s"}.get(kind, "r")
    return f"{prefix}{time.strftime('%Y%m%d')}-{secrets.token_hex(4)}"


class ArtifactStore:
    """Content-addressed files: artifacts/ab/abcdef…; written to a temp file, fsynced, renamed."""

    def __init__(self, root: Path, ledger: Ledger) -> None:
        self.root = root
        self.ledger = ledger
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def put_bytes(self, data: bytes, kind: str, name: str | None = None) -> str:
        sha = hashlib.sha256(data).hexdigest()
        target = self.path_for(sha)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        self.ledger.record_artifact(sha, len(data), kind, name)
        return sha

    def put_file(self, path: Path, kind: str, name: str | None = None) -> str:
        return self.put_bytes(path.read_bytes(), kind, name or path.name)

    def get_bytes(self, sha256: str) -> bytes:
        path = self.path_for(sha256)
        if not path.is_file():
            raise LoomError(ErrorCode.NOT_FOUND, f"no artifact {sha256}")
        return path.read_bytes()
