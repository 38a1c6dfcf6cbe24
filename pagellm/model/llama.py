"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM) as one flat forward over a paged KV cache.

`forward(input_ids, positions, metadata, kv_caches)` takes one token axis for the whole batch, no padding, and
returns hidden states; `compute_logits` turns the rows that need them into logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.config import ModelConfig
from pagellm.distributed.parallel import TensorParallel, checkpoint_slice, shard_config
from pagellm.kernels.ops import Ops
from pagellm.model.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from pagellm.model.layers import (
    MLP,
    CheckpointTensor,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    read_slice,
)
from pagellm.quantization.config import QuantizationConfig
from pagellm.quantization.linear_methods import LinearMethod, linear_method


class LlamaAttention(nn.Module):
    """`config` is the rank's share (its heads) under tensor parallelism; o_proj sums the ranks' parts."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: Ops,
        tp: TensorParallel,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], ops, bias=config.attention_bias, method=quant_method
        )
        self.o_proj = Linear(q_size, config.hidden_size, ops, method=quant_method)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.split_sizes = [q_size, kv_size, kv_size]
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for the input norm(hidden + residual), and hidden + residual."""
        num_tokens = hidden.shape[0]
        qkv, residual = self.qkv_proj.after_norm(norm, hidden, residual)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rotation = self.rotary.rotation(positions, self.q_norm, self.k_norm)
        out = self.backend.forward(q, k, v, rotation, cache, metadata, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1))), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: Ops,
        tp: TensorParallel,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend, ops, tp, quant_method)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, ops, tp, quant_method)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, cache, metadata)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    """`config` is the whole model's; under tensor parallelism (`tp`) the rank builds its share of every layer and
    `load_weights` reads only that share of each checkpoint tensor. With `quantization` the decoder's linear
    layers hold quantized weights (the embedding and the LM head stay in full precision, as in the checkpoints)."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: Ops,
        max_positions: int,
        tp: TensorParallel | None = None,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.tp = tp = tp or TensorParallel()
        self.quantization = quantization
        quant_method = linear_method(quantization, tp.size) if quantization is not None else None
        local = shard_config(config, tp)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(local, rotary, backend, ops, tp, quant_method) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, self.embed_tokens.num_rows, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        kv_caches: list[LayerKVCache],
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @contextlib.contextmanager
    def first_layers_only(self) -> Iterator[None]:
        """The forward cut to its first two decoder layers, for passes that only need each kernel launched once:
        the first layer's attention block has no residual to add, and from the second on every layer launches the
        same kernels on tensors of the same shapes."""
        layers = self.layers
        self.layers = layers[:2]
        try:
            yield
        finally:
            self.layers = layers

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampling kernel reads them as they are (an fp32 copy of 256 rows of a
        152k vocabulary costs more than the draw); the paths that need fp32 convert. Under tensor parallelism
        every rank gets the whole rows."""
        if self.lm_head is None:
            logits = self.ops.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]

    def pack_for_cpu(self) -> None:
        """Switch the LM head to oneDNN's weight layout (a tied head gets its own packed copy). On the 2-core CPU
        machine oneDNN streams the vocabulary matrix 1.8x faster than MKL's sgemm for 8 rows (as fast for one),
        while the decoder's linears run up to 2x faster through MKL; packed too, they cost batch-1 decode a
        quarter of its speed (benchmarks/results/cpu-2026-12-04*)."""
        if self.lm_head is None:
            self.lm_head = Linear(self.config.hidden_size, self.embed_tokens.num_rows, self.ops)
            self.lm_head.weight.data = self.embed_tokens.weight.data
        self.lm_head.pack_for_cpu()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy HF-named tensors into this model (each rank reads its slice of each); returns the names of the
        parameters that were loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if self._load_quantized(name, source, loaded):
                continue
            tensor = read_slice(source, checkpoint_slice(name, list(source.get_shape()), self.config, self.tp))
            if name in ("embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < self.embed_tokens.num_rows:
                tensor = torch.nn.functional.pad(tensor, (0, 0, 0, self.embed_tokens.num_rows - tensor.shape[0]))
            target = _merged_target(name)
            if target is not None:
                merged_name, shard = target
                module_name, param_name = merged_name.rsplit(".", 1)
                self.get_submodule(module_name).load_shard(param_name, shard, tensor)
                loaded.add(merged_name)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

    def _load_quantized(self, name: str, source: CheckpointTensor, loaded: set[str]) -> bool:
        """Load `name` if it is a quantized layer's tensor: converted to the stored layout whole, then this rank's
        rows (or columns) of the result are kept. False for every other tensor."""
        module_path, component = name.rsplit(".", 1)
        target = _merged_target(name)
        layer_path, shard = (target[0].rsplit(".", 1)[0], target[1]) if target else (module_path, None)
        if self.quantization is None or component == "bias":
            return False
        try:
            layer = self.get_submodule(layer_path)
        except AttributeError:  # not a module of this model: the caller names it in its error
            return False
        if not isinstance(layer, Linear) or layer.method is None:
            return False
        for stored_name, tensor in layer.method.convert(component, read_slice(source, None)):
            if tensor.numel() > 1:  # a single per-tensor scale serves every rank's rows
                part = checkpoint_slice(f"{module_path}.{stored_name}", list(tensor.shape), self.config, self.tp)
                if part is not None:
                    dim, start, size = part
                    tensor = tensor.narrow(dim, start, size)
            layer.method.load(layer, stored_name, shard, tensor)
            loaded.add(f"{layer_path}.{stored_name}")
        return True

    def finalize_quantized_layers(self) -> None:
        """Once every weight is in: each quantized layer folds, reorders or quantizes what it loaded."""
        for module in self.modules():
            if isinstance(module, Linear) and module.method is not None:
                module.method.finalize(module)


_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _merged_target(name: str) -> tuple[str, int] | None:
    """'layers.3.self_attn.k_proj.weight' -> ('layers.3.self_attn.qkv_proj.weight', 1)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _MERGED:
        merged, shard = _MERGED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard
    return None
