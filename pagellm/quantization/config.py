"""Which quantization a model is served with: the user's `quantization=` and the checkpoint's
`quantization_config`, reconciled into one `QuantizationConfig` (or None: full-precision weights).

vLLM's names: `fp8` (a pre-quantized FP8 checkpoint, or a full-precision one quantized at load with one scale per
output channel), `awq` and `gptq` (INT4/INT8 checkpoints with group scales), `compressed-tensors` (llm-compressor's
FP8 checkpoints, served by the FP8 path), `gguf` (a .gguf file's blocks as stored: the default for .gguf models on
a GPU; the CPU computes on dequantized weights, as it did before).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagellm.errors import invalid_value

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors", "gguf")
# Modules the checkpoints leave unquantized that this engine never quantizes either.
ALWAYS_FULL_PRECISION = ("lm_head",)
GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizationConfig:
    """`method` picks the weight format: 'fp8' (e4m3 weights, one fp32 scale per output row) or 'int' (AWQ, GPTQ,
    GGUF: `bits`-wide integers with scales and zero points per `group_size` input columns; -1: one group per
    row)."""

    method: str  # "fp8" | "int"
    checkpoint_format: str  # how it is stored: "fp8", "compressed-tensors", "awq", "gptq", "gptq_v2", "gguf"
    prequantized: bool  # False: full-precision weights quantized as they load (fp8 only)
    bits: int = 8
    group_size: int = -1
    symmetric: bool = False
    desc_act: bool = False  # GPTQ's act-order: input columns grouped by a permutation (g_idx)
    gguf_file: str | None = None  # where a GGUF's blocks are read from

    @property
    def name(self) -> str:
        if self.method == "fp8":
            return "fp8"
        return {"awq": "awq", "gguf": "gguf"}.get(self.checkpoint_format, "gptq")


def resolve_quantization(engine: EngineConfig, hf_config: dict[str, Any]) -> QuantizationConfig | None:
    """The quantization to serve with. The checkpoint decides its own format; `engine.quantization` must agree
    with it, or (fp8) ask for full-precision weights to be quantized at load. With dummy weights any method runs
    at its defaults (speed work without a checkpoint)."""
    requested, load_format = engine.quantization, engine.load_format
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise invalid_value("quantization", requested, f"one of {QUANTIZATION_METHODS} or None")
    gguf_file = _gguf_file(engine.model) if load_format != "dummy" else None
    if gguf_file is not None and requested in (None, "gguf"):
        if requested is None and engine.resolve_device().type == "cpu":
            return None  # the CPU computes on dequantized weights anyway: the cached conversion loads faster
        return gguf_quantization(gguf_file, explicit=requested == "gguf")
    if requested == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf model file; model={engine.model!r} is not one")
    stored = hf_config.get("quantization_config")
    if stored is not None and load_format != "dummy":
        config = parse_checkpoint_quantization(stored)
        agrees = (
            requested is None
            or requested == config.name
            or (requested == "compressed-tensors" and config.checkpoint_format == "compressed-tensors")
        )
        if not agrees:
            raise ValueError(
                f"quantization={requested!r} does not match the checkpoint, which is quantized with "
                f"quantization_config.quant_method={stored.get('quant_method')!r}; leave quantization unset"
            )
        return config
    if requested is None:
        return None
    if requested in ("fp8", "compressed-tensors"):
        return QuantizationConfig("fp8", "fp8", prequantized=False)
    if load_format == "dummy":
        return QuantizationConfig("int", requested, prequantized=True, bits=4, group_size=128)
    raise ValueError(
        f"quantization={requested!r} needs a checkpoint quantized with it (config.json quantization_config); "
        f"this one is full precision. Make one with `pagellm quantize MODEL OUT --method {requested}`, or use "
        "quantization='fp8', which quantizes at load"
    )


def _gguf_file(model: str | None) -> str | None:
    from pagellm.model.loader import default_model

    path = Path(model or default_model()).expanduser()
    return str(path) if path.suffix == ".gguf" and path.is_file() else None


def gguf_quantization(gguf_file: str, explicit: bool) -> QuantizationConfig | None:
    """The GGUF's decoder linears as stored, in one grouped-integer format wide enough for all of them (the most
    bits, the smallest group: Q4_K beside Q6_K is held as 8-bit groups of 16). A block type the kernels cannot
    run falls back to dequantized weights, or is an error when quantization='gguf' was asked for."""
    from gguf import GGMLQuantizationType

    from pagellm.model.gguf_convert import gguf_linear_types
    from pagellm.quantization.gguf_blocks import GGUF_FORMATS, supported_names

    types = {GGMLQuantizationType[name] for name in gguf_linear_types(gguf_file)}
    unsupported = sorted(t.name for t in types if t not in GGUF_FORMATS)
    if unsupported:
        message = f"GGUF tensor types {unsupported} cannot run quantized (supported: {supported_names()})"
        if explicit:
            raise ValueError(f"quantization='gguf': {message}")
        logger.warning("%s: loading dequantized weights", message)
        return None
    formats = [GGUF_FORMATS[t] for t in types]
    bits, group = max(b for b, _ in formats), min(g for _, g in formats)
    return QuantizationConfig("int", "gguf", prequantized=True, bits=bits, group_size=group, gguf_file=gguf_file)


def is_gguf_linear(gguf_name: str) -> bool:
    parts = gguf_name.split(".")
    return parts[0] == "blk" and parts[2] in GGUF_LINEARS


def check_tensor_parallel_quantization(config: QuantizationConfig, tp_size: int) -> None:
    if tp_size > 1 and config.method == "int" and (config.desc_act or config.group_size == -1):
        raise ValueError(
            f"tensor_parallel_size={tp_size} is not supported with GPTQ act-order (desc_act) or per-row groups "
            "(group_size -1): their groups do not split over ranks; use tensor_parallel_size=1"
        )


def parse_checkpoint_quantization(stored: dict[str, Any]) -> QuantizationConfig:
    method = stored.get("quant_method")
    if method == "awq":
        return _awq(stored)
    if method == "gptq":
        return _gptq(stored)
    if method == "fp8":
        if stored.get("weight_block_size"):
            raise ValueError(
                f"quantization_config.weight_block_size={stored['weight_block_size']!r}: block-wise FP8 is not "
                "supported; supported: per-tensor or per-channel FP8 scales"
            )
        return QuantizationConfig("fp8", "fp8", prequantized=True)
    if method == "compressed-tensors":
        return _compressed_tensors(stored)
    raise invalid_value("quantization_config.quant_method", method, "one of 'fp8', 'awq', 'gptq', 'compressed-tensors'")


def _awq(stored: dict[str, Any]) -> QuantizationConfig:
    version = str(stored.get("version", "gemm")).lower()
    if version != "gemm":
        raise invalid_value("quantization_config.version", version, "'gemm' (AutoAWQ's GEMM packing)")
    bits = stored.get("bits", stored.get("w_bit", 4))
    if bits != 4:
        raise invalid_value("quantization_config.bits", bits, "4 (AWQ)")
    _check_not_converted(stored.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert")
    return QuantizationConfig(
        "int",
        "awq",
        prequantized=True,
        bits=4,
        group_size=_group_size(stored.get("group_size", stored.get("q_group_size", 128))),
        symmetric=not stored.get("zero_point", True),
    )


def _gptq(stored: dict[str, Any]) -> QuantizationConfig:
    bits = stored.get("bits", 4)
    if bits not in (4, 8):
        raise invalid_value("quantization_config.bits", bits, "4 or 8 (GPTQ)")
    fmt = stored.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise invalid_value("quantization_config.checkpoint_format", fmt, "'gptq' or 'gptq_v2'")
    return QuantizationConfig(
        "int",
        fmt,
        prequantized=True,
        bits=bits,
        group_size=_group_size(stored.get("group_size", 128)),
        symmetric=bool(stored.get("sym", True)),
        desc_act=bool(stored.get("desc_act", False)),
    )


def _compressed_tensors(stored: dict[str, Any]) -> QuantizationConfig:
    fmt = stored.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise invalid_value(
            "quantization_config.format",
            fmt,
            "'float-quantized' (FP8 weights; other compressed-tensors schemes are not supported)",
        )
    _check_not_converted(stored.get("ignore"), "quantization_config.ignore")
    for name, group in (stored.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        field = f"quantization_config.config_groups.{name}.weights"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise invalid_value(f"{field}.type", weights.get("type"), "'float' with num_bits 8 (FP8)")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise invalid_value(f"{field}.strategy", weights.get("strategy"), "'tensor' or 'channel'")
    return QuantizationConfig("fp8", "compressed-tensors", prequantized=True)


def _group_size(value: Any) -> int:
    if value == -1 or (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
        return value
    raise invalid_value("quantization_config.group_size", value, "-1 (per row) or a power of two >= 16")


def _check_not_converted(modules: list[str] | None, field: str) -> None:
    """Only the LM head may stay in full precision: it always does here."""
    others = [m for m in modules or [] if m not in ALWAYS_FULL_PRECISION and not m.endswith("lm_head")]
    if others:
        raise invalid_value(field, others, f"only {list(ALWAYS_FULL_PRECISION)} (decoder linears are quantized)")
