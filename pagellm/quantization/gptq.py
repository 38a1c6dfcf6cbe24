"""GPTQ (Frantar et al., 2022): round one input column at a time and push each column's rounding error onto the
columns not rounded yet, weighted by the inverse Hessian H = X^T X of the layer's calibration inputs, so the
layer's outputs on that data move as little as the grid allows. Group scales and zero points are set when the
rounding reaches a group's first column, from the weights as updated so far. Every layer's inputs are the
full-precision model's (`calibration.py`), not those of the layers rounded before it.

GPTQ needs far more calibration tokens than a layer has inputs (its paper: 128 x 2048). With 4,000 tokens on
SmolLM2 (whose weights are a Q4_1 GGUF's already), each layer's output error fell on held-out text except the
down projections' (up 30-40%), and perplexity rose: 48.6 against round-to-nearest's 39.5 (asymmetric, groups of
64). Round-to-nearest stays the default; `--calibration` asks for this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DAMPING = 0.01  # of the Hessian's mean diagonal, added to its diagonal: keeps the inverse well conditioned
BLOCK = 128  # columns whose updates are applied together to the rest of the matrix


def gptq_quantize(
    weight: torch.Tensor,
    inputs: torch.Tensor,
    bits: int,
    group_size: int,
    grid: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [N, K], scales fp16 [N, K/G], zeros int32 [N, K/G]) with w ~= (q - zero) * scale; `grid` gives a
    group's scale and zero point (the round-to-nearest functions of quantize.py)."""
    w = weight.float().clone()
    n, k = w.shape
    x = inputs.float()
    hessian = x.T @ x
    dead = torch.diag(hessian) == 0  # inputs never active: their weights cannot matter
    hessian[dead, dead] = 1.0
    w[:, dead] = 0.0
    hessian += DAMPING * torch.diag(hessian).mean() * torch.eye(k)
    # The upper Cholesky factor of H^-1: row i holds what rounding column i does to the columns after it.
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    top = 2**bits - 1
    q = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.empty(n, k // group_size, dtype=torch.float16)
    zeros = torch.empty(n, k // group_size, dtype=torch.int32)
    block = max(BLOCK, group_size)
    for start in range(0, k, block):
        end = min(start + block, k)
        w_block, errors = w[:, start:end].clone(), torch.zeros(n, end - start)
        h_block = hinv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:  # a group starts: its grid from its weights as updated so far
                g = column // group_size
                _, group_scale, group_zero = grid(w_block[:, i : i + group_size], bits, group_size)
                scales[:, g], zeros[:, g] = group_scale[:, 0], group_zero[:, 0]
                scale, zero = group_scale[:, 0].float(), group_zero[:, 0].float()
            rounded = ((w_block[:, i] / scale).round() + zero).clamp(0, top)
            q[:, column] = rounded.to(torch.int32)
            error = (w_block[:, i] - (rounded - zero) * scale) / h_block[i, i]
            w_block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return q, scales, zeros
