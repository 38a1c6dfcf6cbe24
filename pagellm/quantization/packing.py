"""Bit packing of small unsigned integers into int32 words, lowest bits first (the engine's stored layout)."""

from __future__ import annotations

import torch


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K] unsigned values below 2**bits -> int32 [..., K * bits / 32]; value j of a word sits at bits
    [bits * j, bits * (j + 1))."""
    per_word = 32 // bits
    if values.shape[-1] % per_word:
        raise ValueError(f"{values.shape[-1]} values do not fill whole int32 words of {per_word}")
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (grouped << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits, as signed int32


def unpack_int32(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> the unsigned values [..., W * 32 / bits] (int32), the inverse of `pack_int32`."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=words.device) * bits
    values = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1)
