"""Builds exp/dyn/candidate.py: the task's candidate plus the dynamic-unit batch-1 kernel."""
from pathlib import Path

root = Path(__file__).resolve().parent.parent
src = (root / "kernels/q4k_gemv/candidate.py").read_text()
kernel = (root / "exp/dyn_kernel.cu").read_text()
anchor = "// ---- Batches 2-8: one launch reads the weight once for every row of x. ----"
assert src.count(anchor) == 1
src = src.replace(anchor, kernel + "\n" + anchor)
decl = "bool q4k_gemv_bn_allow(int max_bytes);\n"
assert src.count(decl) == 1
src = src.replace(
    decl,
    decl
    + "bool q4k_gemv_dyn_allow(int max_bytes);\n"
    + "bool q4k_gemv_dyn_launch(const void* W, const void* x, void* y, void* work, int n_rows, int n_blocks,\n"
    + "                         int x_is_bf16, int stages, int unit_chunks, int grid, int shared_bytes, int dependent,\n"
    + "                         cudaStream_t stream);\n"
    + "bool allow_dynamic(int64_t max_bytes) { return q4k_gemv_dyn_allow((int)max_bytes); }\n"
    + "void launch_dynamic(torch::Tensor weight, torch::Tensor x, torch::Tensor out, torch::Tensor work, int64_t stages,\n"
    + "                    int64_t unit_chunks, int64_t grid, int64_t shared_bytes, bool dependent) {\n"
    + "  const bool ok = q4k_gemv_dyn_launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), work.data_ptr(),\n"
    + "      (int)weight.size(0), (int)(weight.size(1) / 144), x.scalar_type() == at::kBFloat16, (int)stages,\n"
    + "      (int)unit_chunks, (int)grid, (int)shared_bytes, dependent,\n"
    + "      c10::cuda::getCurrentCUDAStream(x.get_device()).stream());\n"
    + '  TORCH_CHECK(ok, "q4k_gemv_dyn launch failed: ", cudaGetErrorString(cudaGetLastError()));\n'
    + "}\n",
)
funcs = 'functions=["allow", "resident", "launch", "resident_batched", "launch_batched"],'
assert src.count(funcs) == 1
src = src.replace(funcs, 'functions=["allow", "resident", "launch", "resident_batched", "launch_batched", "allow_dynamic", "launch_dynamic"],')
allow = "            if not self.module.allow(self.max_shared):"
assert src.count(allow) == 1
src = src.replace(allow, "            self.module.allow_dynamic(self.max_shared)\n" + allow)
method = "    def batched_ctas_per_sm(self"
assert src.count(method) == 1
src = src.replace(
    method,
    '''    def dynamic(self, x, weight_q4k, out, dependent=False, unit_chunks=0, stages=0):
        """Batch 1 on the dynamic-unit kernel (experiment)."""
        n_rows, n_blocks = weight_q4k.shape[0], weight_q4k.shape[1] // BLOCK_BYTES
        n_chunks = -(-n_blocks // 8)
        unit_chunks = unit_chunks or n_chunks
        stages = stages or self.stages_for(n_blocks)
        shared = cuda_shared_bytes(n_blocks, stages) + 8 * stages
        n_tiles = -(-n_rows // CUDA_ROWS)
        parts = -(-n_chunks // unit_chunks)
        key = (n_rows, n_blocks, unit_chunks, x.device.index)
        if not hasattr(self, "work"):
            self.work = {}
        if key not in self.work:
            self.work[key] = torch.zeros(2 + n_tiles + n_tiles * parts * CUDA_ROWS, dtype=torch.int32, device=x.device)
        resident = int(self.module.resident(shared))  # the b1 kernel's; same registers
        grid = self.sms * max(resident, 1)
        self.module.launch_dynamic(weight_q4k, x, out, self.work[key], stages, unit_chunks, grid, shared, dependent)

''' + method,
)
(root / "exp/dyn/candidate.py").write_text(src)
print("written")
