"""The Q4_K GEMV's CUDA kernels for NVIDIA Hopper: the source is q4k_gemv.cu beside this file,
built at first use with torch.utils.cpp_extension.load_inline (nvcc and ninja; one build per
source and compile-time setting, cached under TORCH_EXTENSIONS_DIR) and launched on PyTorch's
current stream, so graph capture records it.

Measured on the H200, the Triton kernel is bound by instruction issue and L1 (about 8
instructions per weight), and Triton would not give the layout that fixes it. Per 16 rows x 256
weights the batch-1 kernel's loop is 153 warp instructions with 8 integer MMAs, against about
1,060 for the Triton kernel (counts and the versions it replaced: docs/kernels/q4k_gemv.md):

- A producer warp streams the weights through a ring of shared-memory chunks (16 rows x 8
  blocks, one 1152-byte bulk copy per row, counted on an mbarrier); eight consumer warps take
  a block of each chunk and release the slot as soon as its codes are in registers. How deep
  the ring is, and how much of it streams before the kernel ahead ends (PDL), depend on what
  that kernel is: the caller says (`cuda_stages`, `items_before_wait`).
- Codes stay bytes: one AND per four codes (`w & 0x0F0F0F0F` gives q, `w & 0xF0F0F0F0` gives
  16 q) makes the A operand of an integer `mma.sync.m16n8k32`: no per-weight arithmetic.
- x becomes integers once per call: per 32-value sub-block, a power of two scales it to
  int16 (max |x| in [2^13, 2^14)), stored as two signed bytes, x = 256 hi + lo; bf16
  activations keep all their bits down to 2^-7 of their sub-block's largest, smaller ones
  round at 2^-14 of it, and the scale is undone in fp32 with the block's scales.
- B's columns 2c and 2c + 1 hold the high and the low bytes of x of one sub-block of chunk c
  (zeros elsewhere): one chain of MMAs on the low nibbles gives every (row, even sub-block)
  sum of both bytes, one on the high nibbles every odd one, exactly in int32, and each lane
  holds exactly the sub-blocks whose scales it decodes. Eight MMAs per block.

The batched kernel (batches 2-8) has the same producer and ring, with the rows of x as the MMA
columns, so one launch reads the weight once for the whole batch. Launch choices (ring depth,
grid, K cut): q4k_gemv_policy.py.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

try:  # the judge imports a candidate's sources as top-level modules, the model as a package
    import q4k_gemv_policy as policy
except ModuleNotFoundError:
    from kernels.q4k_gemv import q4k_gemv_policy as policy

# What this module reads (`cuda_source`); the candidate declares it too, so its jobs have it.
SOURCES = ["q4k_gemv.cu"]

CUDA_BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

bool q4k_gemv_b1_allow(int max_bytes);
int q4k_gemv_b1_resident(int shared_bytes);
bool q4k_gemv_b1_launch(const void* W, const void* x, void* y, int n_rows, int n_blocks,
                        int x_is_bf16, int stages, int before_wait, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream);

bool q4k_gemv_bn_allow(int max_bytes);
int q4k_gemv_bn_resident(int shared_bytes);
bool q4k_gemv_bn_launch(const void* W, const void* x, void* y, void* parts, int n_rows, int n_blocks, int batch,
                        int x_is_bf16, int stages, int k_parts, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream);

bool allow(int64_t max_bytes) { return q4k_gemv_b1_allow((int)max_bytes) && q4k_gemv_bn_allow((int)max_bytes); }
int64_t resident_batched(int64_t shared_bytes) { return q4k_gemv_bn_resident((int)shared_bytes); }

void launch_batched(torch::Tensor weight, torch::Tensor x, torch::Tensor out, torch::Tensor parts, int64_t stages,
                    int64_t k_parts, int64_t grid, int64_t shared_bytes, bool dependent) {
  const bool ok = q4k_gemv_bn_launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), parts.data_ptr(),
                                     (int)weight.size(0), (int)(weight.size(1) / 144), (int)x.size(0),
                                     x.scalar_type() == at::kBFloat16, (int)stages, (int)k_parts, (int)grid,
                                     (int)shared_bytes, dependent,
                                     c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(ok, "q4k_gemv_bn launch failed: ", cudaGetErrorString(cudaGetLastError()));
}
int64_t resident(int64_t shared_bytes) { return q4k_gemv_b1_resident((int)shared_bytes); }

void launch(torch::Tensor weight, torch::Tensor x, torch::Tensor out, int64_t stages, int64_t before_wait,
            int64_t grid, int64_t shared_bytes, bool dependent) {
  const bool ok = q4k_gemv_b1_launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), (int)weight.size(0),
                                     (int)(weight.size(1) / 144), x.scalar_type() == at::kBFloat16, (int)stages,
                                     (int)before_wait, (int)grid, (int)shared_bytes, dependent,
                                     c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(ok, "q4k_gemv_b1 launch failed: ", cudaGetErrorString(cudaGetLastError()));
}
"""


def cuda_source() -> str:
    """The kernels' CUDA source, q4k_gemv.cu."""
    return Path(__file__).with_name("q4k_gemv.cu").read_text(encoding="utf-8")


class CudaGemvB1:
    """The CUDA kernel for one device, built by load_inline (one build per source and
    compile-time setting, cached by PyTorch under TORCH_EXTENSIONS_DIR)."""

    def __init__(
        self,
        device: torch.device,
        stages: int = 0,
        ctas_per_sm: int = 0,
        min_ctas: int = policy.CUDA_MIN_CTAS,
        source: str | None = None,
        binding: str = CUDA_BINDING,
    ) -> None:
        """`stages`: ring slots per CTA (0: `ring_slots` of the shape); `ctas_per_sm`: resident
        CTAs per SM in the persistent grid (0: as many as fit); `min_ctas`: the CTAs per SM the
        compiler must leave registers for; `source` and `binding`: what to build (by default
        q4k_gemv.cu and CUDA_BINDING; the timeline tool builds an instrumented copy)."""
        from torch.utils.cpp_extension import load_inline

        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            raise RuntimeError(f"needs sm_90 (bulk copies, mbarriers); this GPU is sm_{major}{minor}")
        if major > 9 and os.environ.get("LOOM_Q4K_CUDA") != "1":
            # The PTX it uses exists there, but it has only been checked on Hopper.
            raise RuntimeError(f"checked on sm_90 only; LOOM_Q4K_CUDA=1 tries it on sm_{major}{minor}")
        source = cuda_source() if source is None else source
        flags = [f"MIN_CTAS={min_ctas}"]
        with torch.cuda.device(device):
            self.module = load_inline(
                # the source's hash in the name: two sources never share (and overwrite) a build
                name="loom_q4k_gemv_b1_"
                + hashlib.sha1(source.encode()).hexdigest()[:10]
                + "_"
                + "_".join(flag.replace("=", "") for flag in flags).lower(),
                cpp_sources=binding,
                cuda_sources=source,
                functions=["allow", "resident", "launch", "resident_batched", "launch_batched"],
                extra_cuda_cflags=[
                    "-O3",
                    f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
                    *[f"-D{flag}" for flag in flags],
                ],
                verbose=False,
            )
        self.stages, self.ctas_per_sm = stages, ctas_per_sm
        self.max_shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        with torch.cuda.device(device):
            if not self.module.allow(self.max_shared):
                raise RuntimeError(f"could not allow {self.max_shared} bytes of shared memory")
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.per_sm: dict[int, int] = {}  # by shared memory per CTA
        self.batched_per_sm: dict[tuple[int, int, int], int] = {}
        self.stages_by_blocks: dict[tuple[int, bool], int] = {}

    def stages_for(self, n_blocks: int, follows_small_kernel: bool = False) -> int:
        key = (n_blocks, follows_small_kernel)
        if key not in self.stages_by_blocks:  # settled at a shape's first launch
            self.stages_by_blocks[key] = self.stages or policy.ring_slots(n_blocks, follows_small_kernel)
        return self.stages_by_blocks[key]

    def shared_bytes(self, n_blocks: int, follows_small_kernel: bool = False) -> int:
        return policy.cuda_shared_bytes(n_blocks, self.stages_for(n_blocks, follows_small_kernel))

    def fits(self, n_blocks: int, follows_small_kernel: bool = False) -> bool:
        shared = self.shared_bytes(n_blocks, follows_small_kernel)
        return shared <= self.max_shared and self._resident(shared) > 0

    def _resident(self, shared: int) -> int:
        if shared not in self.per_sm:
            self.per_sm[shared] = int(self.module.resident(shared))
        return self.per_sm[shared]

    def grid(self, n_rows: int, n_blocks: int, follows_small_kernel: bool = False) -> int:
        """The persistent grid over every SM full of resident CTAs (`balanced_grid`)."""
        resident = self._resident(self.shared_bytes(n_blocks, follows_small_kernel))
        return policy.balanced_grid(n_rows, self.sms * (self.ctas_per_sm or max(resident, 1)))

    def _batched_per_sm(self, n_blocks: int, batch: int, stages: int, k_parts: int) -> int:
        k_parts = policy.whole_parts(n_blocks, k_parts)
        key = (n_blocks, batch, stages, k_parts)
        if key not in self.batched_per_sm:
            shared = policy.cuda_batched_shared_bytes(n_blocks, batch, stages, k_parts)
            fits = shared <= self.max_shared
            self.batched_per_sm[key] = int(self.module.resident_batched(shared)) if fits else 0
        return self.batched_per_sm[key]

    def batched_k_parts(self, n_blocks: int, batch: int, n_rows: int, stages: int = policy.CUDA_BATCHED_STAGES) -> int:
        """The parts of K the batched kernel takes here (`batched_k_parts`)."""
        return policy.batched_k_parts(
            n_blocks, batch, lambda parts: self._batched_per_sm(n_blocks, batch, stages, parts), n_rows, self.sms
        )

    def batched_ctas_per_sm(
        self, n_blocks: int, batch: int, n_rows: int, stages: int = policy.CUDA_BATCHED_STAGES, k_parts: int = 0
    ) -> int:
        """CTAs of the batched kernel an SM holds at this K, batch, row count and ring depth, K
        cut into `k_parts` (0: as `batched_k_parts` cuts it); 0: none fits."""
        if not 2 <= batch <= policy.MAX_BATCH_PER_PROGRAM:
            return 0
        k_parts = k_parts or self.batched_k_parts(n_blocks, batch, n_rows, stages)
        return self._batched_per_sm(n_blocks, batch, stages, k_parts)

    def batched_fits(
        self, n_blocks: int, batch: int, n_rows: int, stages: int = policy.CUDA_BATCHED_STAGES, k_parts: int = 0
    ) -> bool:
        """Whether the batched kernel's shared memory fits a CTA at this K, batch and ring depth."""
        return self.batched_ctas_per_sm(n_blocks, batch, n_rows, stages, k_parts) > 0

    def batched(
        self,
        x: torch.Tensor,
        weight_q4k: torch.Tensor,
        out: torch.Tensor,
        dependent: bool = False,
        stages: int = policy.CUDA_BATCHED_STAGES,
        k_parts: int = 0,
    ) -> None:
        """Batches 2-8 in one launch that reads the weight once (`batched_fits` first); where K
        is cut into parts (`k_parts`, 0: `batched_k_parts`), a second small launch adds the
        parts' float sums into `out`."""
        n_rows, n_blocks, batch = weight_q4k.shape[0], weight_q4k.shape[1] // policy.BLOCK_BYTES, x.shape[0]
        k_parts = (
            policy.whole_parts(n_blocks, k_parts) if k_parts else self.batched_k_parts(n_blocks, batch, n_rows, stages)
        )
        shared = policy.cuda_batched_shared_bytes(n_blocks, batch, stages, k_parts)
        resident = self.sms * max(self.batched_ctas_per_sm(n_blocks, batch, n_rows, stages, k_parts), 1)
        grid = k_parts * policy.balanced_grid(n_rows, max(resident // k_parts, 1))  # the same CTAs for every part
        parts = torch.empty((k_parts, batch, n_rows) if k_parts > 1 else (0,), dtype=torch.float32, device=x.device)
        self.module.launch_batched(
            weight_q4k,
            x,
            out,
            parts,
            stages,
            k_parts,
            grid,
            shared,
            dependent and os.environ.get("LOOM_Q4K_PDL") != "0",
        )

    def __call__(
        self,
        x: torch.Tensor,
        weight_q4k: torch.Tensor,
        out: torch.Tensor,
        dependent: bool = False,
        follows_small_kernel: bool = False,
    ) -> None:
        """y = x @ W.T for x [batch, K]: one launch per row of x, each reading the whole weight.

        `dependent`: launch the first row as a programmatic dependent of the kernel before it in
        the stream, whose weight reads then start before that kernel's writes are visible: only
        for a weight no kernel writes (see q4k_gemv's constant_weight). Every later row is a
        dependent whatever the caller says: the kernel before it is this GEMV, which writes no
        weight, and it started only after everything before it in the stream had finished.
        `follows_small_kernel`: the ring depth and prefetch for that context (`cuda_stages`,
        `items_before_wait`), taken only by a single row: a batch's rows after the first follow
        this GEMV itself, and one depth serves all of a call's launches."""
        n_rows, n_blocks = weight_q4k.shape[0], weight_q4k.shape[1] // policy.BLOCK_BYTES
        after = follows_small_kernel and x.shape[0] == 1
        stages = self.stages_for(n_blocks, after)
        grid, shared = self.grid(n_rows, n_blocks, after), self.shared_bytes(n_blocks, after)
        tiles = -(-n_rows // policy.CUDA_ROWS)
        items = -(-tiles // grid) * -(-n_blocks // policy.CUDA_CHUNK_BLOCKS)  # the busiest CTA's (tile, chunk) pairs
        before_wait = policy.items_before_wait(items, stages, after)
        pdl = os.environ.get("LOOM_Q4K_PDL") != "0"
        for row in range(x.shape[0]):
            self.module.launch(
                weight_q4k,
                x[row : row + 1],
                out[row : row + 1],
                stages,
                before_wait,
                grid,
                shared,
                pdl and (dependent or row > 0),
            )


_cuda_kernels: dict[int, CudaGemvB1 | None] = {}


def cuda_gemv_b1(device: torch.device) -> CudaGemvB1 | None:
    """The built kernel for `device`, or None where it cannot be built here (said once on
    stderr: no nvcc or ninja, or not a Hopper GPU); LOOM_Q4K_CUDA=0 turns it off, =1 also
    tries it past Hopper."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_kernels:
        kernel = None
        if os.environ.get("LOOM_Q4K_CUDA", "1") != "0" and torch.version.cuda:
            source = cuda_source()  # outside the try: a missing source is an error, not a fallback
            try:
                kernel = CudaGemvB1(torch.device("cuda", index), source=source)
            except (RuntimeError, OSError, ImportError) as exc:
                print(f"q4k_gemv: the CUDA kernel is unavailable, using Triton: {exc}", file=sys.stderr)
        _cuda_kernels[index] = kernel
    return _cuda_kernels[index]
