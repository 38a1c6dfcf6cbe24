"""The Python heap that start-up leaves: frozen, so that the garbage collector's full passes while serving skip it."""

from __future__ import annotations

import gc


def freeze_start_up_heap() -> None:
    """Collect, then move every object alive into the permanent generation, which the cyclic garbage collector
    never scans. Unfrozen, the start-up heap (the model's modules, torch's and Triton's objects: some 300,000)
    made one full collection mid-run take 130 ms (on this project's 2-core CPU machine), the GPU idle meanwhile:
    one step of 123-147 ms among steps of 6-16 ms in each standard-workload run (H100 and H200,
    results/step-timeline-*-2026-12-07, ab-freeze-heap-merge-skip-2026-12-07). Frozen objects are still freed when
    nothing refers to them; only garbage cycles among them would outlive that (the engine forms none: `del llm`
    frees it by reference counting alone)."""
    gc.collect()
    gc.freeze()
