"""The reference's side of validation's device hand-over: big cases lent in device memory.

A case's inputs (and the reference's weights) are copied into a region of the reference's own
(loom_mcp.worker.cuda_ipc) with an output slot per expected output after them, and the case's
manifest names the region instead of files. The candidate computes on the inputs where they lie
and copies its outputs into the slots. Nothing crosses the host or the disk: a KernelBench case
of 6 GiB in and 6 GiB out spent 7-10 s in files per case in the candidate alone.

What the candidate put in the slots is copied out by a watcher thread as soon as the server has
taken the case's published manifest (validate.runner.OutputTaker), and only then is the case
marked taken (`<cases_dir>/c<i>.taken`, in the reference's directory, which the candidate cannot
write): the candidate's harness waits for that mark before running candidate code again, so a
later case's code cannot rewrite an earlier case's answer (as with files). The region is then
free for a later case. Regions are freed when the job ends, after the candidate has exited.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from loom_mcp.worker import cuda_ipc, handoff

# Cases smaller than this keep to files: the region's set-up costs more than it saves there.
LEND_MIN_BYTES = 64 << 20
REGIONS = 2  # cases in flight: the one the candidate runs and the next


def taken_mark(cases_dir: str | Path, index: int) -> Path:
    return Path(cases_dir) / f"c{index}.taken"


SlotSpecs = list[tuple[torch.dtype, list[int]]]


def _tensor_bytes(values: list) -> int:
    return sum(cuda_ipc.aligned(v.numel() * v.element_size()) for v in values if isinstance(v, torch.Tensor))


def _slot_sizes(specs: SlotSpecs) -> list[int]:
    return [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for dtype, shape in specs]


def _case_need(values: list, specs: SlotSpecs) -> int:
    """Region bytes for a case: its top-level tensors and its output slots, each aligned."""
    return _tensor_bytes(values) + sum(cuda_ipc.aligned(n) for n in _slot_sizes(specs))


def _unwritten(slot: torch.Tensor) -> None:
    """A slot's bytes before the candidate writes: NaN (ints: their largest value), so a slot the
    candidate leaves unwritten cannot pass by chance."""
    if slot.is_floating_point() or slot.is_complex():
        slot.fill_(float("nan"))
    elif slot.dtype == torch.bool:
        slot.fill_(True)
    else:
        slot.fill_(torch.iinfo(slot.dtype).max)


class CaseLender:
    """Regions for the cases in flight, their output slots, and the copies taken of the slots.
    `lend_case` blocks until a region is free (an earlier case taken, or the candidate gone)."""

    def __init__(self, device: torch.device, request: dict, count: int, budget_bytes: int) -> None:
        self.device, self.count, self.budget = cuda_ipc.indexed(device), count, budget_bytes
        self.cases_dir, self.published = request["cases_dir"], request["outputs_dir"]
        self.go_file: str | None = request.get("go_file")
        self.regions: list[cuda_ipc.Region] = []
        self.free: list[cuda_ipc.Region] = []
        self.in_use: dict[int, cuda_ipc.Region] = {}
        self.slots: dict[int, list[torch.Tensor]] = {}
        self.copies: dict[int, list[torch.Tensor]] = {}
        self.errors: dict[int, str] = {}
        self.cond = threading.Condition()
        self.final = False
        self.lent = 0  # cases lent so far
        self.reserve = 0  # device bytes the copies of slots leave free (see _copy)
        self.stream: Any = None  # the watcher's own, made on its thread
        self.watcher = threading.Thread(target=self._watch, name="loom-slot-watcher", daemon=True)
        self.watcher.start()

    # ---------------------------------------------------------------- writing cases
    def wants(self, values: list, slot_specs: SlotSpecs | None) -> bool:
        """Whether a case of these tensors (and slots) is lent rather than written to files."""
        return self.wants_bytes(_case_need(values, slot_specs or []))

    def wants_bytes(self, need: int) -> bool:
        """Whether a case that needs `need` bytes of region is lent."""
        return need >= LEND_MIN_BYTES and need * REGIONS <= self.budget

    def _region(self, need: int) -> cuda_ipc.Region | None:
        """A free region of at least `need` bytes, waiting for one while REGIONS are in use."""
        with self.cond:
            while not self.free and len(self.regions) >= REGIONS:
                if self._candidate_gone():
                    return None
                self.cond.wait(0.05)
            fit = next((r for r in self.free if r.nbytes >= need), None)
            if fit is not None:
                self.free.remove(fit)
                return fit
        if sum(r.nbytes for r in self.regions) + need > self.budget:
            return None  # a region too small stays mapped in the candidate: never freed while it runs
        try:
            region = cuda_ipc.Region(need, self.device)
        except (cuda_ipc.IpcError, torch.OutOfMemoryError, RuntimeError):
            return None  # the device is full (the candidate may hold it): this case goes to files
        self.regions.append(region)
        return region

    def lend_case(self, index: int, value: dict, slot_specs: SlotSpecs | None) -> bool:
        """Write case `index` (`value`: seed, inputs, init_inputs, state_dict) with its tensors
        and output slots in a region. False when none could be had: write it to files then."""
        specs = slot_specs or []
        slot_sizes = _slot_sizes(specs)
        tensors = [*value["inputs"], *value["init_inputs"], *value["state_dict"].values()]
        region = self._region(max(_case_need(tensors, specs), cuda_ipc.ALIGN))
        if region is None:
            return False
        base = region.tensor
        assert base is not None
        # The slots first, then each tensor as the writer meets it.
        slots: list[torch.Tensor] = []
        slot_at: dict[int, int] = {}
        at = 0
        for (dtype, shape), nbytes in zip(specs, slot_sizes, strict=True):
            slot = base[at : at + nbytes].view(dtype).view(shape)
            _unwritten(slot)
            slots.append(slot)
            slot_at[id(slot)] = at
            at += cuda_ipc.aligned(nbytes)

        def lend(tensor: torch.Tensor) -> dict[str, Any] | None:
            nonlocal at
            offset = slot_at.get(id(tensor))
            if offset is None:
                nbytes = tensor.numel() * tensor.element_size()
                if at + nbytes > region.nbytes:
                    return None  # not counted in `need` (nested in a list): written to files
                base[at : at + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                offset, at = at, at + cuda_ipc.aligned(nbytes)
            return {"handle": region.handle, "size": region.nbytes, "offset": offset}

        with self.cond:
            self.in_use[index], self.slots[index] = region, slots
        writer = handoff.BundleWriter(handoff.case_dir(self.cases_dir, index), lend=lend)
        tree = writer.encode({**value, "slots": slots})
        torch.cuda.synchronize(self.device)  # the bytes are in place before the manifest says so
        writer.close(tree)
        self.lent += 1
        return True

    # ---------------------------------------------------------------- taking outputs
    def _candidate_gone(self) -> bool:
        return bool(self.go_file) and os.path.exists(self.go_file)  # type: ignore[arg-type]

    def _take(self, index: int) -> None:
        slots = self.slots.get(index)
        if slots and handoff.slot_case(self.published, index):
            try:
                self.copies[index] = [self._copy(s) for s in slots]
            except Exception as exc:  # out of memory, most likely: the case cannot be judged
                self.errors[index] = f"the candidate's outputs could not be copied: {type(exc).__name__}: {exc}"
        taken_mark(self.cases_dir, index).touch()

    def _copy(self, slot: torch.Tensor) -> torch.Tensor:
        """On the device while it keeps `reserve` free (what the reference needs for one case
        after the candidate exits), else on the host. On a stream of its own: the candidate waits
        for this, not for whatever the main thread has queued (a float64 reference ahead)."""
        nbytes = slot.numel() * slot.element_size()
        free, _ = torch.cuda.mem_get_info(self.device)
        with torch.cuda.stream(self.stream):
            out = slot.clone() if free - nbytes > self.reserve + (2 << 30) else slot.to("cpu")
        self.stream.synchronize()
        return out

    def _release(self, index: int) -> None:
        with self.cond:
            region = self.in_use.pop(index, None)
            self.slots.pop(index, None)
            if region is not None:
                self.free.append(region)
            self.cond.notify_all()

    def _watch(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream(self.device)
            index = 0
            while index < self.count:
                if handoff.case_written(self.published, index):
                    self._take(index)
                    self._release(index)
                    index += 1
                elif self.final:
                    break
                else:
                    time.sleep(0.002)
        finally:
            # Cases never published (or this thread failing): their regions are free for the
            # reference's own writing to finish; the cases have no copies, so they fail.
            with self.cond:
                self.free.extend(self.in_use.values())
                self.in_use.clear()
                self.cond.notify_all()

    def finish(self) -> None:
        """Once the candidate has exited (and the server took what it published): take what is
        left, stop watching, free the regions (the comparison needs the memory)."""
        self.final = True
        self.watcher.join()
        self.close()

    def outputs(self, index: int) -> tuple[list[torch.Tensor] | None, str | None]:
        """Case `index`'s slot copies (or None), and why they are missing (or None)."""
        return self.copies.get(index), self.errors.get(index)

    def close(self) -> None:
        """Free every region once the candidate's process has exited; before that (this job
        failing early) they are left to this process's exit."""
        self.final = True
        if self.watcher.is_alive():
            self.watcher.join(timeout=5)
        if not self._candidate_gone():
            return
        for region in self.regions:
            region.free()
        self.regions, self.free = [], []


def budget_bytes(device: torch.device) -> int:
    """Device memory the lent regions may take: a quarter of the device (with the reference's
    ahead store's quarter, half the device stays the candidate's)."""
    return torch.cuda.get_device_properties(cuda_ipc.indexed(device)).total_memory // 4
