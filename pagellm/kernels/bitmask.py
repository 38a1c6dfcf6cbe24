"""Triton: structured outputs' token bitmask applied to rows of logits, in place.

Bit t % 32 of word t // 32 of a row's bitmask (int32, xgrammar's layout) is set when token t is allowed; a clear
bit sets the token's logit to -inf. Grid (row, vocabulary block); only the constrained rows are launched, named by
`rows`. `reference.apply_token_bitmask` is the twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program


@triton.jit(do_not_specialize=["vocab"])
def _apply_bitmask_kernel(logits_ptr, stride_l, bitmask_ptr, stride_b, rows_ptr, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(bitmask_ptr + i * stride_b + tokens // 32, mask=in_vocab, other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row.to(tl.int64) * stride_l + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Same contract as `reference.apply_token_bitmask`: logits [N, V] (rows contiguous), bitmask [len(rows),
    ceil(V / 32)] int32 and rows [R] int32 on the logits' device."""
    vocab = logits.shape[1]
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(vocab, BLOCK))
        _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, BLOCK=BLOCK)
