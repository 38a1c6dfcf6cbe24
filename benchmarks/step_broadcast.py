"""What sending one step's plain data to the other tensor-parallel ranks costs: `broadcast_object_list` over the
gloo group (the executor's way, of the step as the executor sends it: no sampling token lists), for decode steps
of 1 to 256 rows of a 2,048-token context, two ranks on this host; less the barrier that ends each measurement.
The host work of a step is the budget it comes out of.

    python benchmarks/step_broadcast.py
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm.core.step import SamplingRow, SchedulerOutput, StepRow  # noqa: E402
from pagellm.distributed.executor import free_port, without_sampling_inputs  # noqa: E402
from pagellm.sampling_params import SamplingParams  # noqa: E402

ROWS = (1, 16, 64, 256)
REPEATS = 200
CONTEXT = 2048
BLOCK = 16


def decode_step(rows: int) -> SchedulerOutput:
    params = SamplingParams(temperature=0.8, top_p=0.95)
    blocks = list(range(CONTEXT // BLOCK))
    return SchedulerOutput(
        [
            StepRow(f"req-{i}", CONTEXT - 1, 1, [42], blocks, SamplingRow(params, 100, [1] * 100, [2] * 100))
            for i in range(rows)
        ]
    )


def rank_main(rank: int, init_method: str, results) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    barrier = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        dist.barrier()
        barrier.append(time.perf_counter() - start)
    for rows in ROWS:
        step = without_sampling_inputs(decode_step(rows))
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            message = [step if rank == 0 else None]
            dist.broadcast_object_list(message, src=0)
            dist.barrier()  # the receiver has it: the cost includes its unpickling
            times.append(time.perf_counter() - start)
        if rank == 0:
            results.put((rows, len(pickle.dumps(step)), statistics.median(times) - statistics.median(barrier)))
    dist.destroy_process_group()


def main() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, init_method, results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    rows = [results.get() for _ in ROWS]
    for p in ranks:
        p.join()
    table_rows = [{"rows": n, "pickled KiB": size / 1024, "broadcast us (median)": t * 1e6} for n, size, t in rows]
    table = markdown_table(table_rows, list(table_rows[0]))
    write_results("step_broadcast", {"environment": environment(), "rows": table_rows}, table)
    print(table)


if __name__ == "__main__":
    main()
