"""Tensors handed from one worker to another through files (validation's inputs and outputs,
the benchmark's input sets): a directory of raw tensor bytes and a JSON manifest, no zip
container and no pickle.

torch.save wrote every case into one zip archive: a problem with 6 GB of inputs failed inside the
archive writer, and the archive could not outgrow the job's per-file limit (RLIMIT_FSIZE). Here
each tensor's bytes go to files of at most `chunk_bytes` (at most the writer's own per-file limit,
read from the process), and a reader gets them back as tensors: mapped copy-on-write when a big
tensor is in one file (no copy; a write the candidate makes to its inputs stays private), else
read into one allocation. Like the benchmark's exchange (loom_mcp.worker.exchange), the files are
written by one process and only read by the other.

The manifest is plain JSON: a reader trusts nothing in it but names it checks (file names are
plain, dtypes are torch's, sizes must match the files). Values other than tensors are JSON:
numbers, strings, booleans, None, lists, tuples, dicts with string keys, torch dtypes.

On an NVIDIA GPU a writer may lend a tensor instead of writing it: the tensor sits in a device
region the writer allocated (loom_mcp.worker.cuda_ipc) and the manifest names the region's handle
and the offset. Only a reader that is given `open_lent` accepts such entries: the candidate takes
its inputs that way, the trusted side never opens memory named by the candidate. A candidate's
outputs may name the case's output slots (`{"__slot__": k}`) instead, which the trusted side
resolves to its own copies of those slots.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import resource
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
CHUNK_BYTES = 1 << 30
# Tensors at least this big are mapped rather than read: each mapping holds a file descriptor
# (mmap keeps its own), and a model's hundreds of small weights would exhaust them.
MAP_BYTES = 1 << 20
# A manifest is small (tensors are elsewhere); a bigger one is not ours.
MAX_MANIFEST_BYTES = 64 << 20


# Chunks of one tensor are written and read by this many threads at once: the copies between
# memory and the page cache release the GIL, and one thread moved a 6 GiB tensor in seconds.
IO_THREADS = 8


def _each(work, count: int) -> None:
    """work(0) .. work(count - 1), on up to IO_THREADS threads; the first error is raised."""
    if count <= 1:
        for k in range(count):
            work(k)
        return
    with ThreadPoolExecutor(max_workers=min(IO_THREADS, count)) as pool:
        for future in [pool.submit(work, k) for k in range(count)]:
            future.result()


def _file_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _dtype(name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Slot:
    """An output that lies in output slot `index` of its case (written `{"__slot__": index}`)."""

    index: int


# Lends a tensor: the region's {"handle", "size", "offset"} once its bytes are there, or None to
# write it to files after all.
Lender = Callable[[torch.Tensor], dict[str, Any] | None]
# Opens a lent region by handle and size: its bytes as a uint8 tensor.
RegionOpener = Callable[[str, int], torch.Tensor]


class BundleWriter:
    """Writes tensors as they come (each one's bytes go to disk at once, so a worker need not
    hold every case in memory), then the manifest naming them. `close(tree)` publishes it.
    With `lend`, a tensor it takes is lent in device memory instead of written."""

    def __init__(self, directory: str | Path, chunk_bytes: int | None = None, lend: Lender | None = None) -> None:
        self.lend = lend
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        limit = _file_limit()
        chunk = chunk_bytes or CHUNK_BYTES
        self.chunk_bytes = max(1, min(chunk, limit) if limit else chunk)
        self.tensors: list[dict[str, Any]] = []

    def _write_tensor(self, tensor: torch.Tensor) -> int:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"cannot hand over a {tensor.layout} tensor")
        lent = self.lend(tensor) if self.lend is not None else None
        if lent is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.tensors.append(
                {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "nbytes": nbytes, "lent": lent}
            )
            return len(self.tensors) - 1
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        view = memoryview(raw.numpy()) if raw.numel() else memoryview(b"")  # type: ignore[arg-type]
        index = len(self.tensors)
        starts = range(0, len(view), self.chunk_bytes)
        chunks = [f"t{index}.{k}.bin" for k in range(len(starts))]

        def write_chunk(k: int) -> None:
            piece = view[starts[k] : starts[k] + self.chunk_bytes]
            fd = os.open(self.directory / chunks[k], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                while piece:
                    piece = piece[os.write(fd, piece) :]
            finally:
                os.close(fd)

        _each(write_chunk, len(chunks))
        self.tensors.append(
            {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "nbytes": len(view), "chunks": chunks}
        )
        return index

    def encode(self, value: Any) -> Any:
        """`value` as JSON, its tensors written now and named by index."""
        if isinstance(value, torch.Tensor):
            return {"__tensor__": self._write_tensor(value)}
        if isinstance(value, torch.dtype):
            return {"__dtype__": _dtype_name(value)}
        if isinstance(value, Slot):
            return {"__slot__": value.index}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v) for v in value]}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError("only dicts with string keys can be handed over")
            return {"__dict__": [[k, self.encode(v)] for k, v in value.items()]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot hand over a value of type {type(value).__name__}")

    def close(self, tree: Any) -> None:
        body = json.dumps({"version": 1, "tree": tree, "tensors": self.tensors})
        tmp = self.directory / f"{MANIFEST}.tmp"
        tmp.write_text(body, encoding="utf-8")
        os.rename(tmp, self.directory / MANIFEST)


def write_bundle(directory: str | Path, value: Any, chunk_bytes: int | None = None, lend: Lender | None = None) -> None:
    writer = BundleWriter(directory, chunk_bytes, lend)
    writer.close(writer.encode(value))


def _open_plain(directory: Path, name: Any) -> int:
    if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or "\0" in name:
        raise ValueError(f"bad file name in the manifest: {name!r}")
    # Non-blocking: opening a FIFO planted under a manifest's name would otherwise wait forever.
    fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    st = os.fstat(fd)
    # One name only: a second link elsewhere would let its writer change the bytes after they
    # were handed over.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise ValueError(f"{name} is not a plain file with one name")
    os.set_blocking(fd, True)
    return fd


def _lent_tensor(lent: Any, dtype: torch.dtype, shape: list[int], nbytes: int, open_lent: RegionOpener) -> torch.Tensor:
    if not isinstance(lent, dict):
        raise ValueError("bad lent tensor in the manifest")
    handle, size, offset = lent.get("handle"), lent.get("size"), lent.get("offset")
    if not isinstance(handle, str) or type(size) is not int or type(offset) is not int:
        raise ValueError("bad lent tensor in the manifest")
    if offset < 0 or offset + nbytes > size:
        raise ValueError("a lent tensor lies outside its region")
    region = open_lent(handle, size)
    return region[offset : offset + nbytes].view(dtype).view(shape)


def _read_tensor(directory: Path, entry: Any, open_lent: RegionOpener | None = None) -> torch.Tensor:
    if not isinstance(entry, dict):
        raise ValueError("bad tensor entry in the manifest")
    dtype = _dtype(entry.get("dtype"))
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"bad shape in the manifest: {shape!r}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if "lent" in entry:
        if open_lent is None:
            raise ValueError("a tensor lent in device memory, where only files are accepted")
        if entry.get("nbytes") != nbytes:
            raise ValueError("tensor size in the manifest does not match its shape")
        return _lent_tensor(entry["lent"], dtype, shape, nbytes, open_lent)
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or entry.get("nbytes") != nbytes:
        raise ValueError("tensor size in the manifest does not match its shape")
    if len(set(map(str, chunks))) != len(chunks):
        raise ValueError("a file is named twice among a tensor's pieces")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    fds = [_open_plain(directory, name) for name in chunks]
    try:
        sizes = [os.fstat(fd).st_size for fd in fds]
        if sum(sizes) != nbytes or 0 in sizes:
            raise ValueError(f"the files of a {nbytes}-byte tensor hold {sum(sizes)} bytes")
        if len(fds) == 1 and nbytes >= MAP_BYTES:
            # Copy-on-write: no copy of the bytes, and a write stays in this process.
            raw = torch.frombuffer(mmap.mmap(fds[0], nbytes, access=mmap.ACCESS_COPY), dtype=torch.uint8)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8)
            target = memoryview(raw.numpy())  # type: ignore[arg-type]
            offsets = [sum(sizes[:k]) for k in range(len(sizes))]

            def read_chunk(k: int) -> None:
                at, end = offsets[k], offsets[k] + sizes[k]
                while at < end:
                    got = os.readv(fds[k], [target[at:end]])
                    if got <= 0:
                        raise ValueError("a tensor file ended early")
                    at += got

            _each(read_chunk, len(fds))
    finally:
        for fd in fds:
            os.close(fd)
    return raw.view(dtype).view(shape)


class Bundle:
    """A bundle opened for reading: `tree` is its manifest's JSON, `decode(part)` turns a part of
    it into values, reading the tensors it names then (so a worker can take one case at a time).
    `open_lent`: accept tensors lent in device memory (see the module's docstring); `slots`: what
    `{"__slot__": k}` stands for (else such a value is refused)."""

    def __init__(
        self, directory: str | Path, open_lent: RegionOpener | None = None, slots: list[torch.Tensor] | None = None
    ) -> None:
        self.open_lent, self.slots = open_lent, slots
        self.directory = Path(directory)
        fd = _open_plain(self.directory, MANIFEST)
        with open(fd, "rb") as f:
            body = f.read(MAX_MANIFEST_BYTES + 1)
        if len(body) > MAX_MANIFEST_BYTES:
            raise ValueError("the manifest is too large")
        manifest = json.loads(body)
        if not isinstance(manifest, dict) or manifest.get("version") != 1:
            raise ValueError("not a tensor bundle manifest")
        entries = manifest.get("tensors")
        if not isinstance(entries, list):
            raise ValueError("bad manifest")
        self.entries: list[Any] = entries
        self.tree: Any = manifest.get("tree")

    def total_bytes(self) -> int:
        """The bytes its manifest says its tensors hold in files (checked as each is read)."""
        sizes = [0 if "lent" in e else e.get("nbytes") for e in self.entries if isinstance(e, dict)]
        checked = [n for n in sizes if type(n) is int and n >= 0]
        if len(checked) != len(self.entries):
            raise ValueError("bad tensor sizes in the manifest")
        return sum(checked)

    def decode(self, value: Any, depth: int = 0, skip: frozenset[str] = frozenset()) -> Any:
        """`value` (a part of the manifest's tree) as values; entries of dicts keyed by a name in
        `skip` are None, their tensors never read."""
        if depth > 64:
            raise ValueError("the manifest nests too deeply")
        if isinstance(value, list):
            return [self.decode(v, depth + 1, skip) for v in value]
        if isinstance(value, dict):
            if len(value) != 1:
                raise ValueError("bad value in the manifest")
            ((kind, inner),) = value.items()
            if kind == "__tensor__":
                if type(inner) is not int or not 0 <= inner < len(self.entries):
                    raise ValueError("bad tensor index in the manifest")
                return _read_tensor(self.directory, self.entries[inner], self.open_lent)
            if kind == "__slot__":
                if self.slots is None or type(inner) is not int or not 0 <= inner < len(self.slots):
                    raise ValueError("bad output slot in the manifest")
                return self.slots[inner]
            if kind == "__dtype__":
                return _dtype(inner)
            if kind == "__tuple__" and isinstance(inner, list):
                return tuple(self.decode(v, depth + 1, skip) for v in inner)
            if kind == "__dict__" and isinstance(inner, list):
                if not all(isinstance(kv, list) and len(kv) == 2 for kv in inner):
                    raise ValueError("bad dict in the manifest")
                return {str(k): None if k in skip else self.decode(v, depth + 1, skip) for k, v in inner}
            raise ValueError("bad value in the manifest")
        return value


def read_bundle(directory: str | Path) -> Any:
    """The value a BundleWriter wrote in `directory`, all of it."""
    bundle = Bundle(directory)
    return bundle.decode(bundle.tree)


# ---------------------------------------------------------------- cases, one bundle each
# Validation hands cases over one at a time: case i is the bundle in `c{i}/`, and `cases.json`
# says how many there are. A reader takes case i as soon as its manifest exists, so the candidate
# starts on the first case while the rest are still being written, and a writer can delete a case
# the reader has finished with: a problem's cases never have to fit the disk all at once.

COUNT_FILE = "cases.json"


def case_dir(directory: str | Path, index: int) -> Path:
    return Path(directory) / f"c{index}"


def write_case(directory: str | Path, index: int, value: Any, lend: Lender | None = None) -> None:
    write_bundle(case_dir(directory, index), value, lend=lend)


def slot_refs(count: int) -> list[Slot]:
    """A case's outputs, each in the output slot of its position."""
    return [Slot(k) for k in range(count)]


def slot_case(directory: str | Path, index: int) -> bool:
    """Whether case `index`'s published outputs name output slots (read from its manifest's
    JSON only; anything unreadable is no slot case)."""
    try:
        tree = Bundle(case_dir(directory, index)).tree
    except Exception:  # the candidate wrote it: a manifest nested to a RecursionError, ...
        return False
    return isinstance(tree, list) and any(isinstance(v, dict) and "__slot__" in v for v in tree)


def write_count(directory: str | Path, count: int) -> None:
    """Publish how many cases `directory` holds (or will hold): written once, atomically."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    tmp = Path(directory) / f"{COUNT_FILE}.tmp"
    tmp.write_text(json.dumps({"cases": int(count)}), encoding="utf-8")
    os.rename(tmp, Path(directory) / COUNT_FILE)


def case_written(directory: str | Path, index: int) -> bool:
    return (case_dir(directory, index) / MANIFEST).is_file()


def _wait(path: Path, deadline: float) -> None:
    delay = 0.002
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def read_count(directory: str | Path, wait_s: float = 0.0) -> int:
    """How many cases `directory` holds, waiting up to `wait_s` for the count to be published."""
    path = Path(directory) / COUNT_FILE
    _wait(path, time.monotonic() + wait_s)
    fd = _open_plain(Path(directory), COUNT_FILE)
    with open(fd, "rb") as f:
        body = json.loads(f.read(4096))
    count = body.get("cases") if isinstance(body, dict) else None
    if type(count) is not int or count < 0:
        raise ValueError(f"bad case count in {path}")
    return count


def read_case(
    directory: str | Path,
    index: int,
    wait_s: float = 0.0,
    max_bytes: int | None = None,
    open_lent: RegionOpener | None = None,
    slots: list[torch.Tensor] | None = None,
) -> Any:
    """Case `index`, waiting up to `wait_s` for its writer to publish it; refused (ValueError)
    when its tensors would take more than `max_bytes` of files before any is read. `open_lent`
    and `slots` as for Bundle."""
    _wait(case_dir(directory, index) / MANIFEST, time.monotonic() + wait_s)
    bundle = Bundle(case_dir(directory, index), open_lent, slots)
    if max_bytes is not None and bundle.total_bytes() > max_bytes:
        raise ValueError(f"{bundle.total_bytes()} bytes of tensors, more than the {max_bytes} expected")
    return bundle.decode(bundle.tree)


def read_cases(directory: str | Path, wait_s: float = 0.0) -> list[Any]:
    """Every case, each waited for in turn."""
    return [read_case(directory, i, wait_s) for i in range(read_count(directory, wait_s))]


def write_cases(directory: str | Path, values: list[Any]) -> None:
    for index, value in enumerate(values):
        write_case(directory, index, value)
    write_count(directory, len(values))
