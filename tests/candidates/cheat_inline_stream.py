"""Cheat: inline CUDA that creates its own non-blocking stream and a host thread."""

import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <thread>

__global__ void copy_kernel(const float* x, float* y, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

torch::Tensor fast_copy(torch::Tensor x) {
    auto y = torch::empty_like(x);
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    int64_t n = x.numel();
    std::thread([=]() {
        copy_kernel<<<(n + 255) / 256, 256, 0, s>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
    }).detach();
    return y;
}
"""

ext = load_inline(
    name="fast_copy",
    cpp_sources="torch::Tensor fast_copy(torch::Tensor x);",
    cuda_sources=cuda_source,
    functions=["fast_copy"],
)


class ModelNew(nn.Module):
    def forward(self, x):
        return ext.fast_copy(x)
