"""`profile_step.critical_path`: each kernel's share of the GPU timeline, on hand-made profiler events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.profile_step import critical_path

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name: str, start: float, end: float, device=CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_overlapped_launches_count_only_how_far_they_move_the_end():
    events = [
        event("gemv", 0, 10),
        event("attention", 6, 14),  # launched early (PDL): only 4 us past the GEMV's end
        event("merge", 8, 12),  # ends inside the attention: moves nothing
        event("launch", 0, 30, device=CPU),  # host events are not on the GPU timeline
        event("gemv", 20, 25),  # after 6 us with no kernel
    ]
    rows = {r["name"]: r for r in critical_path(reversed(events), steps=2)}  # any order
    assert rows["gemv"]["us_per_step"] == pytest.approx((10 + 5) / 2)
    assert rows["attention"]["us_per_step"] == pytest.approx(4 / 2)
    assert rows["merge"]["us_per_step"] == 0 and rows["merge"]["calls_per_step"] == 0.5
    assert rows["(idle)"]["us_per_step"] == pytest.approx(6 / 2)
    assert "launch" not in rows
    assert sum(r["us_per_step"] for r in rows.values()) == pytest.approx(25 / 2)  # the timeline's span
    assert [r["name"] for r in critical_path(events, 2)][0] == "gemv"  # largest share first


def test_no_kernels_no_rows():
    assert critical_path([event("launch", 0, 5, device=CPU)], steps=1) == []
