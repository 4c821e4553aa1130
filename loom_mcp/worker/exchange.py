"""Tensors the benchmark's timer shares with its arms, described in plain JSON.

On a CPU they are files the timer creates: the input sets in a directory every arm may read
(mapped read-only), each arm's output slots in a directory only that arm may write. Nothing sits
in a shared /dev/shm, so an arm sees neither the other arm's outputs nor anything the timer keeps
to itself (which output positions it will read). On a GPU the same slots are CUDA allocations of
the timer's, passed as IPC handles (the pickle goes from the trusted timer to the arms only).
"""

from __future__ import annotations

import pickle
import warnings
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its reducers
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA reducers)

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def dtype_named(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return DTYPES[name]


def file_tensor(path: Path, dtype: torch.dtype, shape: list[int], writable: bool, create: bool = False) -> torch.Tensor:
    """A tensor over a file's bytes (MAP_SHARED): what one process writes the other reads."""
    numel = int(np.prod(shape)) if shape else 1
    nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
    mode = "w+" if create else ("r+" if writable else "r")
    raw = np.memmap(str(path), dtype=np.uint8, mode=mode, shape=(nbytes,))  # type: ignore[call-overload]
    with warnings.catch_warnings():
        # torch warns that it cannot honour a read-only array: the mapping itself is read-only,
        # so a write faults instead of reaching the timer's file.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat[: numel * flat.new_empty((), dtype=dtype).element_size()].view(dtype).view(shape)


def share_inputs(sets: list[list], directory: Path | None) -> Any:
    """Describe the timer's live input sets for the arms (creating the CPU files)."""
    if directory is None:  # GPU
        return {"pickle": ForkingPickler.dumps(sets).hex()}
    described = []
    for i, values in enumerate(sets):
        row = []
        for j, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                path = directory / f"in{i}_{j}.bin"
                mapped = file_tensor(path, value.dtype, list(value.shape), True, create=True)
                mapped.copy_(value)
                values[j] = mapped  # the timer perturbs the mapping itself from now on
                row.append(
                    {"file": str(path), "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
                )
            else:
                row.append({"value": value})
        described.append(row)
    return {"files": described}


def open_inputs(description: dict) -> list[list]:
    """The arm's view of the timer's input sets."""
    if "pickle" in description:
        return pickle.loads(bytes.fromhex(description["pickle"]))  # from the trusted timer
    return [
        [
            file_tensor(Path(d["file"]), dtype_named(d["dtype"]), list(d["shape"]), False)
            if "file" in d
            else d["value"]
            for d in row
        ]
        for row in description["files"]
    ]


def output_slots(
    specs: list[dict], directory: Path | None, device: torch.device, max_bytes: int
) -> tuple[list[torch.Tensor], Any]:
    """Byte buffers for one arm's outputs, owned by the timer, and their description for the
    arm. `specs` (from the arm) is checked: it only sizes buffers."""
    slots, described, total = [], [], 0
    for k, spec in enumerate(specs):
        nbytes = int(spec["nbytes"])
        total += nbytes
        if nbytes < 0 or total > max_bytes:
            raise ValueError(f"outputs of {total} bytes: more than the {max_bytes} allowed")
        if directory is None:
            slots.append(torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device))
        else:
            path = directory / f"out{k}.bin"
            slots.append(file_tensor(path, torch.uint8, [max(nbytes, 1)], True, create=True))
            described.append(str(path))
    if directory is None:
        return slots, {"pickle": ForkingPickler.dumps(slots).hex()}
    return slots, {"files": described}


def open_slots(description: dict) -> list[torch.Tensor]:
    """The arm's writable view of its output slots."""
    if "pickle" in description:
        return pickle.loads(bytes.fromhex(description["pickle"]))
    return [file_tensor(Path(path), torch.uint8, [Path(path).stat().st_size], True) for path in description["files"]]


def output_specs(outputs: list) -> list[dict]:
    return [
        {
            "nbytes": out.numel() * out.element_size(),
            "dtype": str(out.dtype).removeprefix("torch."),
            "shape": list(out.shape),
        }
        for out in outputs
    ]


def put(slot: torch.Tensor, out: torch.Tensor) -> None:
    """Copy an output's bytes into its slot (on the current stream on a GPU)."""
    data = out.detach().contiguous().reshape(-1)
    if data.numel():
        slot[: data.numel() * data.element_size()].copy_(data.view(torch.uint8), non_blocking=True)


def read_at(slot: torch.Tensor, spec: dict, positions: torch.Tensor) -> torch.Tensor:
    """The output held in `slot` (as `spec` describes it) at `positions` (mod its size), as
    float64 on the slot's device: the timer's sample, positions never shown to the arm."""
    dtype = dtype_named(spec["dtype"])
    size = torch.empty((), dtype=dtype).element_size()
    numel = int(spec["nbytes"]) // size
    if numel == 0:
        return torch.empty(0, dtype=torch.float64, device=slot.device)
    values = slot[: numel * size].view(dtype)
    picked = values.index_select(0, positions.to(slot.device).remainder(numel))
    return picked.real.double() if picked.is_complex() else picked.double()
