"""Triton: y = x @ W^T for one row x (batch-1 decode), W [N, K] in nn.Linear's row-major layout.

Batch-1 decode streams every weight once per token, so its matmuls are bandwidth-bound matrix-vector products.
Each program reads BLOCK_N whole rows of W in BLOCK_K-wide tiles (contiguous, pipelined loads) and reduces them
against x in fp32. With many small programs the whole GPU keeps loads in flight; cuBLAS, given one row, falls well
short of HBM bandwidth, most on small projections (benchmarks/results/kernels-2026-12-02).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced once at the end, not per tile
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_mask = cols < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        x = tl.load(x_ptr + cols, mask=c_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=r_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the best of a sweep on the H200 over Llama-3.1-8B and Qwen3
    shapes (weights L2-resident in that sweep, so its ranking, not its absolute times, carries over)."""
    if n > 16384:
        return 16, 256, 4, 3
    return 8, 512, 8 if k > 8192 else 4, 4


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T -> [1, N], in x's dtype."""
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=warps,
        num_stages=stages,
    )
    return out
