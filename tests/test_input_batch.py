"""build_host_batch: plain rows to the flat arrays of one forward pass, checked entry by entry; which CUDA graph
a batch replays; a mixed step split into its decodes and its chunks computes what the whole step does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM
from pagellm.core.step import PromptScoring, SamplingRow, SchedulerOutput, StepRow
from pagellm.runner.cuda_graphs import GraphShape, capture_sizes, graph_shape, prefill_capture_sizes, split_shapes
from pagellm.runner.input_batch import build_host_batch, split_mixed
from pagellm.sampling_params import SamplingParams

BLOCK = 4
PARAMS = SamplingParams(temperature=0)


def sampling(draw_index: int = 0) -> SamplingRow:
    return SamplingRow(PARAMS, draw_index, [1], [])


def test_decodes_first_then_chunks_with_slots_positions_and_tables():
    chunk = StepRow(
        "chunk", start=2, num_tokens=5, token_ids=[10, 11, 12, 13, 14], block_ids=[7, 3], sampling=sampling()
    )
    decode = StepRow("decode", start=9, num_tokens=1, token_ids=[20], block_ids=[5, 6, 1], sampling=sampling(3))
    middle = StepRow("middle", start=0, num_tokens=3, token_ids=[30, 31, 32], block_ids=[2])  # samples nothing
    batch = build_host_batch(SchedulerOutput([chunk, decode, middle]), BLOCK)
    assert batch.num_decodes == 1 and batch.max_query_len == 5 and not batch.is_decode_only
    assert batch.input_ids.tolist() == [20, 10, 11, 12, 13, 14, 30, 31, 32]
    assert batch.positions.tolist() == [9, 2, 3, 4, 5, 6, 0, 1, 2]
    # slot = block_ids[pos // 4] * 4 + pos % 4
    assert batch.slot_mapping.tolist() == [
        1 * 4 + 1,
        7 * 4 + 2,
        7 * 4 + 3,
        3 * 4 + 0,
        3 * 4 + 1,
        3 * 4 + 2,
        2 * 4 + 0,
        2 * 4 + 1,
        2 * 4 + 2,
    ]
    assert batch.query_start_loc.tolist() == [0, 1, 6, 9]
    assert batch.seq_lens.tolist() == [10, 7, 3]
    assert batch.block_tables.tolist() == [[5, 6, 1], [7, 3, 0], [2, 0, 0]]  # zero-padded
    assert batch.logits_indices.tolist() == [0, 5]  # each sampling row's last token, in batch order
    assert batch.sampling_ids == ["decode", "chunk"]
    assert [r.draw_index for r in batch.sampling_rows] == [3, 0]
    assert batch.pending_ids == [] and batch.input_ids.dtype == np.int64


def test_prompt_logprob_rows_follow_the_sampling_rows():
    row = StepRow(
        "p",
        start=0,
        num_tokens=4,
        token_ids=[1, 2, 3, 4],
        block_ids=[0],
        sampling=sampling(),
        prompt_scoring=PromptScoring(2, [2, 3, 4]),
    )
    other = StepRow(
        "q", start=3, num_tokens=2, token_ids=[8, 9], block_ids=[1, 2], prompt_scoring=PromptScoring(1, [9])
    )
    batch = build_host_batch(SchedulerOutput([row, other]), BLOCK)
    assert batch.logits_indices.tolist() == [3, 0, 1, 2, 4]
    (p, q) = batch.prompt_logprob_rows
    assert (p.request_id, p.rows, p.targets, p.first_position, p.top_n) == ("p", [1, 2, 3], [2, 3, 4], 0, 2)
    assert (q.request_id, q.rows, q.targets, q.first_position) == ("q", [4], [9], 3)


def test_pending_inputs_are_placeholders_and_must_lead():
    pending = [
        StepRow(rid, start=6, num_tokens=1, token_ids=[], block_ids=[0, 1], sampling=sampling(1)) for rid in ("a", "b")
    ]
    batch = build_host_batch(SchedulerOutput(pending), BLOCK)
    assert batch.is_decode_only and batch.pending_ids == ["a", "b"] and batch.input_ids.tolist() == [0, 0]
    known = StepRow("c", start=6, num_tokens=1, token_ids=[5], block_ids=[0, 1], sampling=sampling(1))
    with pytest.raises(ValueError, match="pending"):
        build_host_batch(SchedulerOutput([known, *pending]), BLOCK)


def prefill(name: str, num_tokens: int, start: int = 0, scoring: PromptScoring | None = None) -> StepRow:
    blocks = list(range(-(-(start + num_tokens) // BLOCK)))
    return StepRow(name, start, num_tokens, [1] * num_tokens, blocks, sampling=sampling(), prompt_scoring=scoring)


def test_graph_shapes_of_decode_and_short_prefill_steps():
    decode_sizes, prefill_sizes = capture_sizes(24), prefill_capture_sizes(256)
    assert decode_sizes == [1, 2, 4, 8, 16, 24] and prefill_sizes == [16, 32, 64, 128, 256]

    def shape(*rows: StepRow) -> GraphShape | None:
        return graph_shape(build_host_batch(SchedulerOutput(list(rows)), BLOCK), decode_sizes, prefill_sizes)

    decodes = [StepRow(f"d{i}", 5, 1, [3], [0, 1], sampling=sampling()) for i in range(25)]
    assert shape(*decodes[:3]) == GraphShape(4, 4, True)
    assert shape(*decodes) is None  # more sequences than the largest decode graph
    assert shape(prefill("a", 100)) == GraphShape(128, 4, False)
    assert shape(prefill("a", 17, start=32), prefill("b", 40)) == GraphShape(64, 4, False)  # a cached prefix too
    assert shape(*(prefill(str(i), 5) for i in range(4))) == GraphShape(32, 4, False)
    assert shape(*(prefill(str(i), 5) for i in range(5))) is None  # one sequence more than the grid covers
    assert shape(prefill("a", 257)) is None  # past the ladder
    assert shape(prefill("a", 20), decodes[0]) is None  # decodes beside prefills: two graphs (split_shapes)
    assert shape(prefill("a", 20, scoring=PromptScoring(0, [1] * 19))) is None  # prompt logprobs read every row


def test_split_shapes_of_mixed_steps():
    decode_sizes, prefill_sizes = capture_sizes(24), prefill_capture_sizes(256)

    def shapes(*rows: StepRow) -> tuple[GraphShape, GraphShape] | None:
        return split_shapes(build_host_batch(SchedulerOutput(list(rows)), BLOCK), decode_sizes, prefill_sizes)

    decodes = [StepRow(f"d{i}", 5, 1, [3], [0, 1], sampling=sampling()) for i in range(25)]
    assert shapes(*decodes[:3], prefill("a", 100)) == (GraphShape(4, 4, True), GraphShape(128, 4, False))
    assert shapes(*decodes[:17], *(prefill(str(i), 5) for i in range(4))) == (
        GraphShape(24, 24, True),
        GraphShape(32, 4, False),
    )
    assert shapes(*decodes[:3]) is None  # decodes only: one graph
    assert shapes(prefill("a", 100)) is None  # prefills only: one graph
    assert shapes(*decodes, prefill("a", 100)) is None  # more decodes than the largest decode graph
    assert shapes(decodes[0], *(prefill(str(i), 5) for i in range(5))) is None  # chunks past the prefill grid
    assert shapes(decodes[0], prefill("a", 257)) is None  # chunk tokens past the ladder
    assert shapes(decodes[0], prefill("a", 20, scoring=PromptScoring(0, [1] * 19))) is None


def test_split_mixed_keeps_each_part_in_its_own_coordinates():
    chunk = StepRow("chunk", 2, 5, [10, 11, 12, 13, 14], [7, 3], sampling=sampling())
    decodes = [StepRow(f"d{i}", 9, 1, [], [5, 6, 1], sampling=sampling(i)) for i in range(2)]  # pending inputs
    middle = StepRow("middle", 0, 3, [30, 31, 32], [2])  # samples nothing
    batch = build_host_batch(SchedulerOutput([*decodes, chunk, middle]), BLOCK)
    head, tail = split_mixed(batch)
    assert head.is_decode_only and head.num_tokens == 2 and head.seq_lens.tolist() == [10, 10]
    assert head.logits_indices.tolist() == [0, 1] and head.sampling_ids == ["d0", "d1"]
    assert head.pending_ids == ["d0", "d1"] and head.block_tables.tolist() == [[5, 6, 1], [5, 6, 1]]
    assert tail.num_decodes == 0 and tail.input_ids.tolist() == [10, 11, 12, 13, 14, 30, 31, 32]
    assert tail.query_start_loc.tolist() == [0, 5, 8] and tail.seq_lens.tolist() == [7, 3]
    assert tail.logits_indices.tolist() == [4] and tail.sampling_ids == ["chunk"] and tail.pending_ids == []
    assert tail.positions.tolist() == batch.positions[2:].tolist()
    assert tail.slot_mapping.tolist() == batch.slot_mapping[2:].tolist()
    with pytest.raises(ValueError, match="decodes and prefill chunks"):
        split_mixed(build_host_batch(SchedulerOutput(decodes), BLOCK))


def test_a_split_mixed_step_computes_the_whole_step(tiny_llama_dir):
    """On the CPU (fp32): a step's logits equal its decodes' and then its chunks' forward passes, over KV written
    by an earlier step (a decode at position 20, a chunk continuing a cached prefix, a fresh chunk)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True, num_kv_blocks=16, block_size=4)
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (21, 14, 6)]

    def forward(rows: list[StepRow]) -> torch.Tensor:
        batch = build_host_batch(SchedulerOutput(rows), 4)
        return runner._forward(batch, None, runner.kv_caches)

    def run_parts(rows: list[StepRow]) -> torch.Tensor:
        head, tail = split_mixed(build_host_batch(SchedulerOutput(rows), 4))
        return torch.cat([runner._forward(part, None, runner.kv_caches) for part in (head, tail)])

    a_blocks, b_blocks, c_blocks = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11]
    forward([StepRow("a", 0, 20, ids[0][:20], a_blocks), StepRow("b", 0, 8, ids[1][:8], b_blocks)])
    mixed = [
        StepRow("a", 20, 1, ids[0][20:], a_blocks, sampling=sampling()),
        StepRow("b", 8, 6, ids[1][8:], b_blocks, sampling=sampling()),
        StepRow("c", 0, 6, ids[2], c_blocks, sampling=sampling()),
    ]
    torch.testing.assert_close(run_parts(mixed), forward(mixed), rtol=1e-5, atol=1e-5)
