"""The sampling defaults a model's creators ship in its generation_config.json, applied as vLLM applies them
(`generation_config="auto"`, its default): a request's temperature, top_p, top_k, min_p and repetition_penalty that it
leaves unset take the file's values, and the file's max_new_tokens is the default and the ceiling of max_tokens.
"vllm" ignores the file; a directory's generation_config.json replaces the model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.errors import InvalidParameter
from pagellm.sampling_params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path, setting: str) -> dict[str, Any]:
    """SamplingParams fields and values from the generation config that `setting` names ("auto": the model's,
    "vllm": none, or a directory); {} where the model has none."""
    if setting == "vllm":
        return {}
    path = (model_dir if setting == "auto" else Path(setting)) / "generation_config.json"
    if not path.is_file():
        if setting == "auto":
            return {}
        raise InvalidParameter(
            "generation_config",
            f"generation_config={setting!r}: no generation_config.json there; "
            "pass 'auto' (the model's), 'vllm' (none) or a directory holding one",
        )
    try:
        config = json.loads(path.read_text())
        defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
        if config.get("max_new_tokens") is not None:
            defaults["max_tokens"] = config["max_new_tokens"]
        SamplingParams(**defaults)
    except (ValueError, TypeError, AttributeError) as exc:  # not JSON, not an object, or values out of range
        raise InvalidParameter(
            "generation_config", f"{path}: {exc} (generation_config='vllm' ignores the file)"
        ) from None
    return defaults
