"""The ledger (SQLite, WAL) and the content-addressed artifact store under LOOM_HOME.

Every tool call is written when it starts and again when it ends, each in its own
transaction, so a `kill -9` at any moment leaves every answered call intact and the
unfinished one marked `running` until the next open turns it into `interrupted`.

Only a missing ledger is created (built aside, then linked into place, so no half-made file
is ever seen). An existing file is checked before anything is written to it: SQLite header,
`PRAGMA quick_check`, and the tables its schema version promises. A file that fails (0 bytes,
truncated, garbage, another program's database) is refused with [LEDGER_CORRUPT] and a
recovery hint; it is never replaced or "repaired" by starting afresh.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shlex
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
    """
    -- the task's module-level overrides (batch_size, dim, ...) every judged run of it uses
    ALTER TABLE campaigns ADD COLUMN task_globals_json TEXT;
    """,
    """
    -- the server's config fingerprint (gate policy) in force when the attempt was judged
    ALTER TABLE submissions ADD COLUMN config_fingerprint TEXT;
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)

SQLITE_HEADER = b"SQLite format 3\x00"


def _statements(script: str) -> list[str]:
    return [statement for statement in script.split(";") if statement.strip()]


@functools.cache
def expected_tables(version: int) -> dict[str, frozenset[str]]:
    """Table -> column names that a ledger at schema `version` has (built from MIGRATIONS)."""
    db = sqlite3.connect(":memory:")
    try:
        for script in MIGRATIONS[:version]:
            for statement in _statements(script):
                db.execute(statement)
        return _tables(db)
    finally:
        db.close()


def _tables(db: sqlite3.Connection) -> dict[str, frozenset[str]]:
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
    return {name: frozenset(r[1] for r in db.execute(f'PRAGMA table_info("{name}")')) for name in names}


def _sqlite_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def ledger_recovery_hint(path: Path, empty: bool = False) -> str:
    p = shlex.quote(str(path))
    aside = f"mv {p} {shlex.quote(str(path) + '.broken')}"
    side = f" (and {p}-wal / {p}-shm if present)"
    if empty:
        return (
            f"It holds no records: move it aside ({aside}{side}) or delete it; a server that "
            "finds no ledger creates a new one."
        )
    return (
        f"loom-mcp will not start on it and never replaces an existing ledger. To save what it "
        f"holds: sqlite3 {p} .recover | sqlite3 {shlex.quote(str(path) + '.recovered')} and, if "
        f"that works, move the .recovered file into its place; to start with an empty ledger, "
        f"move it aside: {aside}{side}; a server that finds no ledger creates a new one."
    )


def _corrupt(path: Path, reason: str, empty: bool = False) -> LoomError:
    return LoomError(ErrorCode.LEDGER_CORRUPT, f"ledger {path} {reason}. {ledger_recovery_hint(path, empty)}")


def check_ledger(path: Path, db: sqlite3.Connection | None = None) -> int:
    """Refuse (LEDGER_CORRUPT) an existing ledger that is not a sound loom ledger; return its
    schema version. Reads only: nothing is written to the file."""
    size = path.stat().st_size
    if size == 0:
        raise _corrupt(
            path, "is empty (0 bytes: a copy cut short, or a first start killed before it wrote anything)", empty=True
        )
    with open(path, "rb") as fh:
        header = fh.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise _corrupt(path, f"is not an SQLite database (its {size} bytes do not start with the SQLite header)")
    own = db is None
    if own:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=30)
    assert db is not None  # the caller's connection, or the one opened just above
    try:
        try:
            problems = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            tables = _tables(db)
        except sqlite3.DatabaseError as exc:
            if (
                _sqlite_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
                or "malformed" in str(exc)
                or "not a database" in str(exc)
            ):
                raise _corrupt(path, f"is damaged (SQLite: {exc}; truncated or overwritten?)") from exc
            raise
    finally:
        if own:
            db.close()
    if problems != ["ok"]:
        shown = "; ".join(problems[:3]) + (f"; … {len(problems) - 3} more" if len(problems) > 3 else "")
        raise _corrupt(path, f"fails SQLite's integrity check ({shown})")
    if version > SCHEMA_VERSION:
        raise LoomError(
            ErrorCode.INTERNAL,
            f"ledger {path} has schema v{version}, newer than this loom-mcp (v{SCHEMA_VERSION}); upgrade loom-mcp",
        )
    if version == 0:
        if tables:  # someone else's database, or a ledger whose version stamp was wiped
            raise _corrupt(
                path,
                f"is an SQLite database without a loom schema version, holding "
                f"tables {', '.join(sorted(tables))}: not a loom ledger",
            )
        return 0  # a ledger whose first migration never committed: nothing in it yet
    wrong = []
    for table, columns in expected_tables(version).items():
        if table not in tables:
            wrong.append(f"table {table} is missing")
        elif columns - tables[table]:
            wrong.append(f"table {table} lacks {', '.join(sorted(columns - tables[table]))}")
    if wrong:
        raise _corrupt(path, f"does not have the schema its version (v{version}) promises: {'; '.join(wrong)}")
    return version


def _create_ledger(path: Path) -> None:
    """Build an empty, fully migrated ledger beside `path` and link it into place. Never replaces
    a file: if another process created the ledger first, theirs is kept."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".ledger-new-", suffix=".sqlite3")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            for number, script in enumerate(MIGRATIONS, start=1):
                for statement in _statements(script):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={number}")
            db.execute("COMMIT")
        finally:
            db.close()  # the last connection checkpoints the WAL into the file and removes it
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            if path.exists():  # no hard links here: a rename can replace, so look first
                return
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm"), Path(f"{tmp}-journal")):
            leftover.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
        if not os.path.lexists(path):
            _create_ledger(path)
        # mode=rw: never create here; a ledger that vanished between the look and the open is an
        # error, not an invitation to start an empty one.
        self._db = sqlite3.connect(
            f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=30, isolation_level=None, check_same_thread=False
        )
        try:
            check_ledger(path, self._db)
        except BaseException:
            self._db.close()
            raise
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
                    for statement in _statements(script):
                        self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={number}")
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        """Roll back if a transaction is still open. SQLite may already have rolled back itself
        (a COMMIT that hit a full disk); a second error must not hide the first."""
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

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
                self._rollback()
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
            assert cur.lastrowid is not None  # set by the INSERT just run
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
    def insert_run(
        self,
        run_id: str,
        kind: str,
        record_sha: str,
        summary: dict[str, Any],
        campaign_id: str | None = None,
        reuse_key: str | None = None,
    ) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO runs(id, kind, campaign_id, created_at, record_sha, summary_json, reuse_key)"
                " VALUES (?,?,?,?,?,?,?)",
                (run_id, kind, campaign_id, time.time(), record_sha, orjson.dumps(summary).decode(), reuse_key),
            )

    def runs_with_key(self, kind: str, reuse_key: str) -> list[dict[str, Any]]:
        """Every run of `kind` whose evidence was computed from exactly the same inputs, newest
        first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM runs WHERE kind=? AND reuse_key=? ORDER BY created_at DESC", (kind, reuse_key)
            ).fetchall()
        return [dict(r) for r in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return dict(row) if row else None

    def runs_of(self, campaign_id: str, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM runs WHERE campaign_id=? AND kind=? ORDER BY created_at", (campaign_id, kind)
            ).fetchall()
        return [dict(r) for r in rows]

    # -- submissions
    def insert_submission(self, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.transaction() as db:
            db.execute(f"INSERT INTO submissions({cols}) VALUES ({marks})", tuple(row.values()))

    SUBMISSION_FIELDS = frozenset(
        {"status", "finished_at", "validation_id", "benchmark_id", "verdict_json", "commit_sha", "worktree"}
    )

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
                "SELECT id, pid FROM submissions WHERE campaign_id=? AND status='running'", (campaign_id,)
            ).fetchall()
        return {r["id"] for r in rows if r["pid"] == os.getpid() or _pid_alive(r["pid"])}

    def clear_worktree(self, submission_id: str) -> None:
        self.update_submission(submission_id, worktree=None)

    # -- artifacts
    def record_artifact(self, sha256: str, size: int, kind: str, name: str | None) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO artifacts(sha256, size, kind, name, created_at) VALUES (?,?,?,?,?)",
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
