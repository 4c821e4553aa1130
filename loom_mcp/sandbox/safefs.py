"""Server-side file access that never follows a link a job (or an agent) planted.

A job writes its own directory (LOOM_HOME/jobs/<id>/...) and its compile cache; the server,
which is not sandboxed, then reads and writes files there. Anything the job could have made a
symlink, a hard link, a FIFO or a device must not redirect the server: a `scrubbed.json`
symlinked to ~/.bashrc once turned the profile tool's trace write into code execution.

Two kinds of path:

* beneath a base directory the server created (a job directory): `base` is trusted and opened
  as given; `rel` is resolved component by component below it with no symlink followed
  anywhere (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS where the kernel has it, else a walk
  of O_NOFOLLOW | O_DIRECTORY opens). '..' and absolute names are refused outright.
* an agent's path (a candidate, a task, a trace), already resolved and checked against the
  allowed roots: `open_resolved` opens exactly that path and refuses if any component has
  become a symlink since it was resolved, so resolution happens once and what was checked is
  what is opened. `open_agent_file` does the resolution and the roots check too.

Reads accept regular files only (a FIFO would block the server, a device could have side
effects: files are opened O_NONBLOCK and checked with fstat), are capped in size, and by default
refuse a job's file with more than one link: a job's outputs are always fresh files, so a second
name means the job linked in a file it did not write. Writes never open an existing file: a new
file is created O_EXCL beneath the directory and renamed over the name, which replaces a planted
link instead of writing through it.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox.openat2 import (
    _AT_FDCWD,
    _DIR_FLAGS,
    _O_CLOEXEC,
    _O_DIRECTORY,
    _O_NOFOLLOW,
    _O_PATH,
    _READ_FLAGS,
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    _raw_openat2,
    openat2_available,
)

# Sources (candidates, tasks, baselines) the server reads itself: far above any real one.
MAX_SOURCE_BYTES = 16 << 20


class UnsafeFileError(LoomError):
    """A path a job or agent controls is a link, not a regular file, too big, or escapes its
    directory. Coded BAD_INPUT: the request (or the job's output) is at fault, not the server."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.BAD_INPUT, message)


# ------------------------------------------------------------------------------------ paths


def _parts(rel: str | os.PathLike[str]) -> list[str]:
    text = os.fspath(rel)
    if "\0" in text:
        raise UnsafeFileError(f"path {text!r} contains a NUL byte")
    pure = PurePosixPath(text)
    if pure.is_absolute():
        raise UnsafeFileError(f"path {text!r} must be relative to its directory")
    parts = [p for p in pure.parts if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeFileError(f"path {text!r} leaves its directory ('..')")
    return parts


def _describe(base: Path | str, rel: str | os.PathLike[str]) -> str:
    return str(PurePosixPath(os.fspath(base)) / os.fspath(rel))


def _translate(exc: OSError, where: str) -> Exception:
    code = exc.errno
    if code == errno.ENOENT:
        return LoomError(ErrorCode.NOT_FOUND, f"{where} does not exist")
    if code in (errno.ELOOP, errno.EXDEV, errno.EMLINK):
        return UnsafeFileError(
            f"{where} is a symbolic link or goes through one (or leaves its "
            "directory); the server never follows links there"
        )
    if code == errno.ENOTDIR:
        return UnsafeFileError(f"{where}: a component is not a directory (or is a link to one)")
    if code == errno.EISDIR:
        return UnsafeFileError(f"{where} is a directory, not a file")
    if code == errno.EEXIST:
        return UnsafeFileError(f"{where} already exists")
    if code in (errno.ENXIO, errno.ENODEV, errno.ETXTBSY):
        return UnsafeFileError(f"{where} is not a regular file")
    if code == errno.ENAMETOOLONG:
        return UnsafeFileError(f"{where[:300]}: a name in the path is too long")
    if code in (errno.EACCES, errno.EPERM):
        return UnsafeFileError(f"{where}: permission denied")
    return exc


def _open_base(base: Path | str) -> int:
    """The trusted directory itself (server-created), opened as named."""
    try:
        return os.open(os.fspath(base), _DIR_FLAGS)
    except OSError as exc:
        raise _translate(exc, str(base)) from exc


def _open_beneath_fd(dirfd: int, parts: list[str], flags: int, mode: int = 0) -> int:
    """Open `parts` below `dirfd`, following no symlink anywhere and never leaving it."""
    flags |= _O_CLOEXEC
    if not parts:
        return os.dup(dirfd) if flags & _O_DIRECTORY else os.open(".", flags, dir_fd=dirfd)
    if openat2_available():
        path = os.fsencode("/".join(parts))
        for _ in range(8):  # EAGAIN: a concurrent rename during resolution; try again
            try:
                return _raw_openat2(
                    dirfd,
                    path,
                    flags,
                    mode if flags & os.O_CREAT else 0,
                    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
                )
            except OSError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
        raise OSError(errno.EAGAIN, "openat2 kept racing a rename", "/".join(parts))
    fd, owned = dirfd, False
    try:
        for part in parts[:-1]:
            # O_PATH: search permission is enough on the way (a link is ENOTDIR/ELOOP here).
            nfd = os.open(part, (_O_PATH or os.O_RDONLY) | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            if owned:
                os.close(fd)
            fd, owned = nfd, True
        return os.open(parts[-1], flags | _O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        if owned:
            os.close(fd)


def open_fd(base: Path | str, rel: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
    """A raw descriptor for `base/rel`, no symlink followed beneath `base` (callers check type)."""
    parts = _parts(rel)
    dirfd = _open_base(base)
    try:
        return _open_beneath_fd(dirfd, parts, flags, mode)
    except OSError as exc:
        raise _translate(exc, _describe(base, rel)) from exc
    finally:
        os.close(dirfd)


def open_dir(base: Path | str, rel: str | os.PathLike[str] = ".") -> int:
    """A directory descriptor for `base/rel` (no links beneath `base`). The caller closes it."""
    return open_fd(base, rel, _DIR_FLAGS)


def _parent_fd(base: Path | str, rel: str | os.PathLike[str]) -> tuple[int, str]:
    parts = _parts(rel)
    if not parts:
        raise UnsafeFileError(f"{_describe(base, rel)} names the directory itself, not a file in it")
    return open_dir(base, "/".join(parts[:-1]) or "."), parts[-1]


# ------------------------------------------------------------------------------------ reading


class _CappedRaw(io.RawIOBase):
    """A descriptor's bytes that refuse to run past `limit` (the file may grow after fstat)."""

    def __init__(self, fd: int, name: str, limit: int | None) -> None:
        super().__init__()
        self._file = io.FileIO(fd, "rb", closefd=True)
        self.name = name
        self._limit = limit

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._file.fileno()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer) -> int | None:  # type: ignore[override]
        n = self._file.readinto(buffer)
        if n and self._limit is not None and self._file.tell() > self._limit:
            raise UnsafeFileError(f"{self.name} grew past {self._limit} bytes while being read")
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def _check_regular(fd: int, where: str, max_bytes: int | None, allow_hardlinks: bool) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{where} is not a regular file (a FIFO, device, socket or directory)")
    if not allow_hardlinks and st.st_nlink > 1:
        raise UnsafeFileError(f"{where} has {st.st_nlink} hard links; a job's own outputs have one, so it is refused")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafeFileError(f"{where} is {st.st_size} bytes, more than the {max_bytes} allowed")
    return st


def _wrap_read(fd: int, where: str, max_bytes: int | None, allow_hardlinks: bool) -> BinaryIO:
    try:
        _check_regular(fd, where, max_bytes, allow_hardlinks)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(_CappedRaw(fd, where, max_bytes))  # type: ignore[return-value]


def open_read(
    base: Path | str, rel: str | os.PathLike[str], *, max_bytes: int | None, allow_hardlinks: bool = False
) -> BinaryIO:
    """A binary file object (seekable; ijson and gzip can stream it) for the regular file
    `base/rel`. Links, non-regular files, more than `max_bytes`, or (unless allowed) a second
    hard link are refused with a coded error."""
    fd = open_fd(base, rel, _READ_FLAGS)
    return _wrap_read(fd, _describe(base, rel), max_bytes, allow_hardlinks)


def _read_all(f: BinaryIO, max_bytes: int | None) -> bytes:
    with f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsafeFileError(f"{getattr(f, 'name', 'file')} is more than {max_bytes} bytes")
    return data


def _decode(data: bytes, where: str, encoding: str, errors: str) -> str:
    try:
        return data.decode(encoding, errors)
    except UnicodeDecodeError as exc:
        raise LoomError(ErrorCode.BAD_INPUT, f"{where} is not {encoding} text: {exc}") from exc


def read_bytes(
    base: Path | str, rel: str | os.PathLike[str], max_bytes: int, *, allow_hardlinks: bool = False
) -> bytes:
    return _read_all(open_read(base, rel, max_bytes=max_bytes, allow_hardlinks=allow_hardlinks), max_bytes)


def read_text(
    base: Path | str,
    rel: str | os.PathLike[str],
    max_bytes: int,
    *,
    encoding: str = "utf-8",
    errors: str = "strict",
    allow_hardlinks: bool = False,
) -> str:
    return _decode(
        read_bytes(base, rel, max_bytes, allow_hardlinks=allow_hardlinks), _describe(base, rel), encoding, errors
    )


# ------------------------------------------------------------------------------------ writing


def create_new(base: Path | str, rel: str | os.PathLike[str], *, mode: int = 0o644) -> BinaryIO:
    """A new file at `base/rel` for writing: any existing name (a planted link, a hard link to
    something else) is unlinked first and the file is created O_EXCL, so nothing existing is
    ever opened for writing. Not atomic (see write_bytes)."""
    pfd, name = _parent_fd(base, rel)
    try:
        try:
            os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            pass
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=pfd)
    except OSError as exc:
        raise _translate(exc, _describe(base, rel)) from exc
    finally:
        os.close(pfd)
    return os.fdopen(fd, "wb")  # type: ignore[return-value]


def write_bytes(
    base: Path | str, rel: str | os.PathLike[str], data: bytes, *, mode: int = 0o644, fsync: bool = False
) -> None:
    """Atomically replace `base/rel` with `data`: a temp file created O_EXCL in the same
    directory, then renamed over the name through the same directory descriptor. A link at the
    name is replaced, never written through; readers see the old file or the whole new one."""
    pfd, name = _parent_fd(base, rel)
    tmp = f".{name[:64]}.{secrets.token_hex(6)}.tmp"
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=pfd)
        except OSError as exc:
            raise _translate(exc, _describe(base, rel)) from exc
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                if fsync:
                    out.flush()
                    os.fsync(out.fileno())
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=pfd)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise _translate(exc, _describe(base, rel)) from exc
            raise
    finally:
        os.close(pfd)


def write_text(
    base: Path | str,
    rel: str | os.PathLike[str],
    text: str,
    *,
    encoding: str = "utf-8",
    mode: int = 0o644,
    fsync: bool = False,
) -> None:
    write_bytes(base, rel, text.encode(encoding), mode=mode, fsync=fsync)


# ------------------------------------------------------------------------------------ metadata


def lstat(base: Path | str, rel: str | os.PathLike[str]) -> os.stat_result | None:
    """lstat of `base/rel` (a link is reported as a link); None when it, or a directory on the
    way to it, is missing or a link."""
    try:
        pfd, name = _parent_fd(base, rel)
    except LoomError:
        return None
    try:
        return os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(pfd)


def exists(base: Path | str, rel: str | os.PathLike[str]) -> bool:
    """Something (a link counts) is at `base/rel`, reached without following links."""
    return lstat(base, rel) is not None


def is_file(base: Path | str, rel: str | os.PathLike[str]) -> bool:
    """`base/rel` is a regular file itself, not a link to one."""
    st = lstat(base, rel)
    return st is not None and stat.S_ISREG(st.st_mode)


def unlink(base: Path | str, rel: str | os.PathLike[str], *, missing_ok: bool = True) -> bool:
    """Remove the name `base/rel` (a link is removed, its target untouched). True if removed."""
    try:
        pfd, name = _parent_fd(base, rel)
    except LoomError as exc:
        if missing_ok and (exc.code == ErrorCode.NOT_FOUND or isinstance(exc, UnsafeFileError)):
            return False  # the directory itself is gone (or a link): nothing of ours to remove
        raise
    try:
        os.unlink(name, dir_fd=pfd)
        return True
    except FileNotFoundError:
        if missing_ok:
            return False
        raise LoomError(ErrorCode.NOT_FOUND, f"{_describe(base, rel)} does not exist") from None
    except OSError as exc:
        raise _translate(exc, _describe(base, rel)) from exc
    finally:
        os.close(pfd)


def remove_tree(base: Path | str, rel: str | os.PathLike[str]) -> None:
    """Remove `base/rel` and everything in it without following any link: a link at the name is
    unlinked, links inside are removed as links (shutil.rmtree's fd-based walk)."""
    st = lstat(base, rel)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        unlink(base, rel)
        return
    pfd, name = _parent_fd(base, rel)
    try:
        if sys.version_info >= (3, 11) and shutil.rmtree.avoids_symlink_attacks:
            shutil.rmtree(name, dir_fd=pfd)
        else:  # pragma: no cover - 3.10: by path; rmtree refuses a link at the top itself
            shutil.rmtree(Path(base) / os.fspath(rel))
    finally:
        os.close(pfd)


def discard(base: Path | str, rel: str | os.PathLike[str]) -> None:
    """Best-effort removal of scratch (`remove_tree`) for cleanup paths: never raises."""
    try:
        remove_tree(base, rel)
    except (LoomError, OSError):
        pass


def find_files(base: Path | str, rel: str | os.PathLike[str], *, suffix: str = "") -> list[tuple[str, int]]:
    """(path relative to `base`, size) of every regular file under `base/rel` whose name ends
    with `suffix`, largest first. Links (to files or directories) are neither listed nor
    followed."""
    prefix = "/".join(_parts(rel))
    try:
        dfd = open_dir(base, rel)
    except LoomError:
        return []
    found: list[tuple[str, int]] = []
    try:
        for dirpath, _dirs, files, dirfd in os.fwalk(".", dir_fd=dfd, follow_symlinks=False):
            for name in files:
                if not name.endswith(suffix):
                    continue
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    inner = os.path.normpath(os.path.join(dirpath, name))
                    found.append(("/".join(p for p in (prefix, inner) if p), st.st_size))
    finally:
        os.close(dfd)
    return sorted(found, key=lambda item: (-item[1], item[0]))


def copy_out(
    base: Path | str, rel: str | os.PathLike[str], dest: Path, *, max_bytes: int, allow_hardlinks: bool = False
) -> int:
    """Copy the job's regular file `base/rel` to the server-owned path `dest` (created new,
    O_EXCL; its directory must be the server's). Returns the bytes copied."""
    dest = Path(dest)
    with (
        open_read(base, rel, max_bytes=max_bytes, allow_hardlinks=allow_hardlinks) as src,
        create_new(dest.parent, dest.name, mode=0o600) as out,
    ):
        shutil.copyfileobj(src, out, 1 << 20)
        return out.tell()


# ------------------------------------------------------------------------------------ agent paths


def open_resolved(path: Path | str, *, max_bytes: int | None, allow_hardlinks: bool = True) -> BinaryIO:
    """Open the regular file at `path`, an absolute path already resolved (no symlinks) and
    checked by the caller, refusing if any of its components is a symlink now: what was checked
    is what is opened. Agent files may have several hard links (worktrees, cp -al), so they are
    allowed here by default."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise UnsafeFileError(f"{text} is not an absolute path")
    norm = os.path.normpath(text)
    parts = [p for p in norm.split("/") if p]
    try:
        if openat2_available():
            fd = -1
            for _ in range(8):
                try:
                    fd = _raw_openat2(
                        _AT_FDCWD, os.fsencode(norm), _READ_FLAGS, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
                    )
                    break
                except OSError as exc:
                    if exc.errno != errno.EAGAIN:
                        raise
            if fd < 0:
                raise OSError(errno.EAGAIN, "openat2 kept racing a rename", norm)
        else:
            root = os.open("/", _DIR_FLAGS)
            try:
                fd = _open_beneath_fd(root, parts, _READ_FLAGS)
            finally:
                os.close(root)
    except OSError as exc:
        raise _translate(exc, norm) from exc
    f = _wrap_read(fd, norm, max_bytes, allow_hardlinks)
    f.raw.name = norm  # type: ignore[attr-defined]
    return f


def read_resolved_bytes(path: Path | str, max_bytes: int = MAX_SOURCE_BYTES) -> bytes:
    """The bytes of an already-resolved agent path (a checked candidate or task file)."""
    return _read_all(open_resolved(path, max_bytes=max_bytes), max_bytes)


def read_resolved_text(
    path: Path | str, max_bytes: int = MAX_SOURCE_BYTES, *, encoding: str = "utf-8", errors: str = "strict"
) -> str:
    return _decode(read_resolved_bytes(path, max_bytes), os.fspath(path), encoding, errors)


def check_resolved_file(path: Path | str, max_bytes: int | None) -> Path:
    """Raise unless `path` (resolved) is a regular file, reached through no symlink, within
    `max_bytes`; return it."""
    with open_resolved(path, max_bytes=max_bytes):
        pass
    return Path(path)


def _within(path: Path, roots: Iterable[Path | str]) -> bool:
    for root in roots:
        r = Path(os.path.realpath(root))
        if path == r or r in path.parents:
            return True
    return False


def resolve_agent_path(path: Path | str, roots: Iterable[Path | str], what: str = "file") -> Path:
    """`path` with every symlink resolved (once), if it lies under one of `roots`."""
    resolved = Path(os.path.realpath(os.path.expanduser(os.fspath(path))))
    roots = list(roots)
    if not _within(resolved, roots):
        raise LoomError(
            ErrorCode.NOT_ALLOWED,
            f"{what} {resolved} is outside the allowed roots ({', '.join(str(r) for r in roots)})",
        )
    return resolved


def open_agent_file(
    path: Path | str, roots: Iterable[Path | str], max_bytes: int | None, *, what: str = "file"
) -> BinaryIO:
    """An agent-named file (a trace, a candidate): resolved once, checked against `roots`, then
    opened with no symlink followed on the way to the resolved path, as a regular file of at
    most `max_bytes`. The file object's `.name` is the resolved path (readers that pick a format
    by suffix can use it); `.raw` refuses reads past `max_bytes` should the file grow."""
    return open_resolved(resolve_agent_path(path, roots, what), max_bytes=max_bytes)
