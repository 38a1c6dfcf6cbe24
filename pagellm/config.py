"""Engine and model configuration.

`ModelConfig` reads the HF `config.json` of a Llama-family model into the few fields the model code needs;
`EngineConfig` holds what the user chose for the engine (cache, batching, device).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagellm.errors import invalid_value
from pagellm.quantization.config import QUANTIZATION_METHODS

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # tokens per step when max_num_batched_tokens is not given
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model architectures={archs!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2/3 carry a sliding_window value but only use it when use_sliding_window is set.
        window = cfg.get("sliding_window")
        if model_type.startswith("qwen") and not cfg.get("use_sliding_window"):
            window = None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope=_rope_config(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32").replace("torch.", ""),
        )

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Bytes one token takes in the KV cache over all layers (INT8 adds one fp32 scale per head)."""
        per_head = self.head_dim * kv_dtype.itemsize + (4 if kv_dtype == torch.int8 else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _option(default: Any, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """An EngineConfig field with what the CLI needs to offer it: help text, allowed values, extra flag names."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass
class EngineConfig:
    """What the user picked for the engine: the one list of engine options. `LLM(...)` keyword arguments and the
    CLI's flags (`--max-num-seqs` for max_num_seqs) are these fields, with these defaults and help texts."""

    model: str | None = _option(
        None, "HF directory, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    device: str | None = _option(None, "cpu or cuda (default: cuda when available)")
    dtype: str = _option("auto", "weights and activations ('auto': the checkpoint's on GPU, float32 on CPU)", DTYPES)
    kv_cache_dtype: str = _option(
        "auto", "KV cache storage ('auto': the model's dtype; int8: per-token scales)", KV_CACHE_DTYPES
    )
    block_size: int = _option(16, "tokens per KV cache block")
    max_num_seqs: int = _option(256, "sequences per step at most")
    max_num_batched_tokens: int | None = _option(
        None, f"tokens per step, prefill chunks and decodes together (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})"
    )
    max_model_len: int | None = _option(
        None,
        "longest sequence, prompt and output (default: the model's limit, "
        "cut to what the KV cache holds when that is known up front)",
    )
    num_kv_blocks: int | None = _option(None, "KV cache blocks (default: sized from the memory left)")
    gpu_memory_utilization: float = _option(0.9, "share of the GPU's memory this engine may use")
    cpu_kv_cache_gib: float = _option(2.0, "KV cache size on the CPU, in GiB")
    enable_prefix_caching: bool = _option(
        True, "reuse the KV blocks of shared prompt prefixes", aliases=("--prefix-caching",)
    )
    enforce_eager: bool = _option(False, "no CUDA graphs")
    async_scheduling: bool = _option(True, "launch a decode step before the previous one's tokens are back")
    seed: int = _option(0, "seed of unseeded requests' sampling (and of dummy weights)")
    load_format: str = _option("auto", "how to read the weights", LOAD_FORMATS)
    quantization: str | None = _option(
        None,
        "quantized weights (default: the checkpoint's quantization_config, and a .gguf's blocks as stored on a "
        "GPU; fp8 also quantizes a full-precision checkpoint at load)",
        QUANTIZATION_METHODS,
        aliases=("-q",),
    )
    tensor_parallel_size: int = _option(
        1, "ranks the model is split over (processes on this host: one GPU each, or gloo on the CPU)", aliases=("-tp",)
    )
    distributed_executor_backend: str = _option(
        "mp",
        "how tensor-parallel ranks start: mp (one process per rank on this host; torchrun's env:// is seen)",
        ("mp",),
    )
    data_parallel_size: int = _option(
        1, "engine replicas, each in its own process (with tensor_parallel_size GPUs each)", aliases=("-dp",)
    )
    generation_config: str = _option(
        "auto",
        "sampling defaults: 'auto' (the model's generation_config.json: temperature, top_p, top_k, min_p, "
        "repetition_penalty for what a request leaves unset, max_new_tokens as the cap of max_tokens), 'vllm' "
        "(none), or a directory holding a generation_config.json",
    )
    chat_template: str | None = _option(
        None, "a chat template replacing the model's: a Jinja file's path, or the template itself"
    )
    quiet: bool = _option(False, "hide progress bars")

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}"
        )
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "a power of two from 1 to 128",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks, ">= 1")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format, f"one of {LOAD_FORMATS}")
        _check(
            self.quantization in (None, *QUANTIZATION_METHODS),
            "quantization",
            self.quantization,
            f"one of {QUANTIZATION_METHODS} or None",
        )
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        _check(
            self.distributed_executor_backend == "mp",
            "distributed_executor_backend",
            self.distributed_executor_backend,
            "'mp'",
        )
        _check(self.data_parallel_size >= 1, "data_parallel_size", self.data_parallel_size, ">= 1")

    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule (prefill chunks and decodes together)."""
        return self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def resolve_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, model: ModelConfig, device: torch.device) -> torch.dtype:
        """'auto' is the checkpoint's dtype on GPU, and float32 on CPU (half-precision matmuls are slow there)."""
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cpu":
            return torch.float32
        name = model.torch_dtype if model.torch_dtype in ("float16", "bfloat16") else "bfloat16"
        return getattr(torch, name)

    def resolve_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.kv_cache_dtype == "auto" else getattr(torch, self.kv_cache_dtype)

    def budgeted_kv_blocks(self, model: ModelConfig) -> int | None:
        """KV cache blocks when they are known before the model is built (num_kv_blocks, or on the CPU what
        cpu_kv_cache_gib holds); None where a GPU memory profile decides."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        device = self.resolve_device()
        if device.type != "cpu":
            return None
        kv_dtype = self.resolve_kv_dtype(self.resolve_dtype(model, device))
        return max(1, int(self.cpu_kv_cache_gib * 2**30 // (model.kv_bytes_per_token(kv_dtype) * self.block_size)))


def engine_option_names() -> list[str]:
    return [f.name for f in fields(EngineConfig)]


def resolve_max_model_len(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence the engine serves, decided once, before the model is built: max_model_len, else the
    model's limit, cut to the KV cache where its size is known up front (`budgeted_kv_blocks`)."""
    limit = model.max_position_embeddings
    if model.sliding_window:  # full attention equals windowed attention up to the window
        limit = min(limit, model.sliding_window)
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} is invalid: the model supports at most {limit} tokens")
    blocks = config.budgeted_kv_blocks(model)
    if blocks is not None and wanted > blocks * config.block_size:
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={config.max_model_len} is invalid: the KV cache holds only "
                f"{blocks * config.block_size} tokens ({blocks} blocks of {config.block_size})"
            )
        wanted = blocks * config.block_size
    return wanted


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise invalid_value(name, value, allowed)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
