"""One list of engine options: the CLI's flags and LLM's keywords are EngineConfig's fields, with its defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagellm import LLM
from pagellm.cli import build_parser, engine_kwargs
from pagellm.config import EngineConfig


@pytest.mark.parametrize("command", ["serve", "generate --prompt hi", "chat"])
def test_every_option_is_a_flag_with_the_config_default(command):
    args = build_parser().parse_args(command.split())
    assert engine_kwargs(args) == dataclasses.asdict(EngineConfig())


def test_flags_set_their_fields():
    args = build_parser().parse_args(
        [
            "serve",
            "--max-num-seqs",
            "3",
            "--no-async-scheduling",
            "--no-prefix-caching",
            "--enforce-eager",
            "--kv-cache-dtype",
            "int8",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    config = EngineConfig(**engine_kwargs(args))
    assert (
        config.max_num_seqs,
        config.async_scheduling,
        config.enable_prefix_caching,
        config.enforce_eager,
        config.kv_cache_dtype,
        config.gpu_memory_utilization,
    ) == (3, False, False, True, "int8", 0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])  # argparse names the choices


def test_llm_takes_the_same_options(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_num_seq: not an engine option.*max_num_seqs"):
        LLM(str(tiny_llama_dir), max_num_seq=4)
    llm = LLM(str(tiny_llama_dir), device="cpu", async_scheduling=False, max_num_seqs=3, quiet=True)
    assert not llm.engine.config.async_scheduling and llm.engine.scheduler.max_num_seqs == 3


def test_max_model_len_is_resolved_once_before_the_runner(tiny_llama_dir):
    # The pool (4 blocks of 16) is known up front: max_model_len is cut to it, and the runner agrees.
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=4, quiet=True)
    assert llm.engine.max_model_len == llm.engine.runner.max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len=100 is invalid: the KV cache holds only 64 tokens"):
        LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=4, max_model_len=100, quiet=True)


def test_kv_pool_holds_at_most_what_max_num_seqs_can_use(tiny_llama_dir):
    """The pool allocates at most max_num_seqs full-length sequences of what memory holds (cpu_kv_cache_gib)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, quiet=True)
    engine = llm.engine
    bytes_per_block = engine.model_config.kv_bytes_per_token(torch.float32) * engine.config.block_size
    assert engine.runner.memory_blocks == int(engine.config.cpu_kv_cache_gib * 2**30 // bytes_per_block)
    assert engine.stats().num_blocks == 2 * 64 // engine.config.block_size + 1 < engine.runner.memory_blocks
