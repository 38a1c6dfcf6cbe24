"""The engine freezes the heap that start-up leaves (pagellm/runner/heap.py), so the collector's full passes skip
it; frozen garbage cycles would never be freed, so an engine must free without the collector."""

from __future__ import annotations

import gc
import weakref

from pagellm import LLM, SamplingParams


def test_start_up_heap_is_frozen_and_an_engine_frees_without_the_collector(tiny_llama_dir):
    gc.unfreeze()
    llm = LLM(str(tiny_llama_dir), quiet=True)
    assert gc.get_freeze_count() > 1000
    assert "freeze_heap" in llm.engine.startup_seconds
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4), use_tqdm=False)
    engine, runner = weakref.ref(llm.engine), weakref.ref(llm.engine.runner)
    gc.disable()  # nothing but reference counting may free them
    try:
        del llm
        assert engine() is None and runner() is None
    finally:
        gc.enable()
