"""Device memory one worker lends another, through CUDA's IPC handles (the driver API, by ctypes).

Validation hands a case's inputs to the candidate, and takes its outputs back, in device memory
the trusted reference allocates for that purpose alone: each region is its own cuMemAlloc, so a
handle to it opens nothing else of the reference's (an allocation of torch's caching allocator
would share its segment with whatever torch put beside it, reference outputs included). Regions
are freed only after the importing process has exited: CUDA leaves freeing an exported region
that another process still maps undefined.

torch's own CUDA IPC (torch.multiprocessing) keeps a reference count in a /dev/shm file named
after the exporter's pid, which each sandboxed job has privately; these handles need none. The
two processes must still have distinct pids (protocol.BENCH_PIDS): the driver tells exporters
apart by pid. NVIDIA only; elsewhere `available` says no and tensors travel through files.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from typing import Any

import torch

HANDLE_BYTES = 64
ALIGN = 256  # every tensor placed in a region starts on this boundary
_LAZY_ENABLE_PEER_ACCESS = 1


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class IpcError(RuntimeError):
    pass


@cache
def _driver() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
    lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
    lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    for name in ("cuMemAlloc_v2", "cuMemFree_v2", "cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise IpcError(f"{what} failed with CUDA driver error {code}")


def available(device: torch.device) -> bool:
    """Whether regions can be lent on `device`: an NVIDIA GPU whose driver library loads, and
    not switched off (LOOM_CUDA_IPC=0)."""
    if device.type != "cuda" or torch.version.hip or os.environ.get("LOOM_CUDA_IPC", "1") == "0":
        return False
    try:
        _driver()
    except OSError:
        return False
    return True


def indexed(device: torch.device) -> torch.device:
    """`device` with its index ("cuda" alone means the current one)."""
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


def _current_context(device: torch.device) -> None:
    """The driver calls below need a current context: torch's (the primary one) made current on
    this thread by any runtime call on the device."""
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)


class _Memory:
    """Device memory at `ptr` as a torch.Tensor without a copy: torch reads the interface and
    keeps this object alive as long as any view of it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _as_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_Memory(ptr, nbytes), device=device)


class Region:
    """A device allocation of the exporter's own, lent whole: `tensor` is its bytes (uint8),
    `handle` what the importer opens it by."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        device = indexed(device)
        _current_context(device)
        self.nbytes, self.device = int(nbytes), device
        ptr = ctypes.c_uint64()
        _check(_driver().cuMemAlloc_v2(ctypes.byref(ptr), self.nbytes), f"allocating {self.nbytes} bytes")
        self.ptr = ptr.value
        handle = _Handle()
        _check(_driver().cuIpcGetMemHandle(ctypes.byref(handle), self.ptr), "exporting a region")
        self.handle = bytes(handle).hex()  # not .reserved: a c_char array stops at the first NUL
        self.tensor: torch.Tensor | None = _as_tensor(self.ptr, self.nbytes, device)

    def free(self) -> None:
        """Only once no other process maps it (see the module's docstring)."""
        if self.tensor is not None:
            self.tensor = None
            torch.cuda.synchronize(self.device)
            _check(_driver().cuMemFree_v2(self.ptr), "freeing a region")


_opened: dict[str, torch.Tensor] = {}


def open_region(handle: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """An exporter's region as a uint8 tensor (opened once per handle; mapped until exit)."""
    if handle in _opened:
        region = _opened[handle]
        if region.numel() != nbytes:
            raise IpcError("a region was described with two sizes")
        return region
    raw = bytes.fromhex(handle)
    if len(raw) != HANDLE_BYTES or nbytes <= 0:
        raise IpcError("not a region handle")
    device = indexed(device)
    _current_context(device)
    ptr = ctypes.c_uint64()
    value = _Handle.from_buffer_copy(raw)
    _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), value, _LAZY_ENABLE_PEER_ACCESS), "opening a region")
    _opened[handle] = region = _as_tensor(ptr.value, nbytes, device)
    return region


def aligned(nbytes: int) -> int:
    return (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN
