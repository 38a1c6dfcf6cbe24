"""GGUF (llama.cpp) quantized tensors as the engine's grouped integers: w = q * scale + offset per group, with q
unsigned, so the INT4/INT8 kernels run them as stored (no dequantized copy).

Every supported block type is exactly such a grid: Q4_0 (w = d * (q - 8)), Q4_1 (d * q + m), Q8_0 (d * x, x int8:
q = x + 128), Q4_K (256-value super-blocks of eight 32-value groups with 6-bit scales and mins: d * sc * q -
dmin * mn), Q6_K (sixteen 16-value groups of 6-bit values: d * sc * (q - 32), held in 8-bit storage).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import Q4_K

Q = GGMLQuantizationType
# Block type -> (bits of storage, values per group).
GGUF_FORMATS: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.Q4_0: (4, 32),
    Q.Q4_1: (4, 32),
    Q.Q8_0: (8, 32),
    Q.Q4_K: (4, 32),
    Q.Q6_K: (8, 16),
}


def decode_blocks(
    tensor_type: GGMLQuantizationType, data: np.ndarray, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The raw bytes of a [rows, K] tensor -> (q int32 [rows, K], scales, offsets fp32 [rows, K / group])."""
    if tensor_type not in GGUF_FORMATS:
        raise ValueError(f"GGUF tensor type {tensor_type.name} cannot run quantized; supported: {supported_names()}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[tensor_type][1])
    q, scale, offset = _DECODERS[tensor_type](blocks)
    values = torch.from_numpy(np.ascontiguousarray(q, dtype=np.int32)).reshape(rows, -1)
    return (
        values,
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).reshape(rows, -1),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32)).reshape(rows, -1),
    )


def supported_names() -> list[str]:
    return [t.name for t in GGUF_FORMATS]


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles_split_halves(qs: np.ndarray) -> np.ndarray:
    """Bytes j of a 16-byte run hold value j (low nibble) and value j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks[:, :2])
    return _nibbles_split_halves(blocks[:, 2:]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    return _nibbles_split_halves(blocks[:, 4:]), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].view(np.int8).astype(np.int32) + 128, d, -128 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    # Each 32-byte run holds two groups: its low nibbles, then its high nibbles.
    return (qs & 0x0F).reshape(n, 256), d * sc, -dmin * mn


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(n, 2, 4, 32) | (high.reshape(n, 2, 4, 32) << 4)
    scale = d * sc
    return q.reshape(n, 256), scale, -32 * scale


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
