"""What sending one step's plain data to the other tensor-parallel ranks costs, for decode steps of 1 to 256 rows of a
2,048-token context (the step as the executor sends it: its host batch, built on rank 0, without the sampling rows),
two ranks on this host: `broadcast_object_list` over the gloo group against the shared-memory ring of `step_channel`
(what the executor uses when the ranks share a host). Each is timed as a round trip, the step to rank 1 and a
one-byte reply back the same way, beside what pickling and unpickling the step cost in one process (the floor of
both). The host work of a step is the budget this comes out of.

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
from pagellm.distributed.executor import for_other_ranks, free_port  # noqa: E402
from pagellm.distributed.step_channel import GlooChannel, ShmChannel  # noqa: E402
from pagellm.runner.input_batch import build_host_batch  # noqa: E402
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
    # Shared memory one way each: rank 0 writes `there` and reads `back`, rank 1 the other way round.
    mine = ShmChannel(1)
    names: list = [None, None]
    dist.all_gather_object(names, mine.name)
    theirs = ShmChannel(1, names[1 - rank], reader=0)
    gloo = GlooChannel(dist.group.WORLD)
    for rows in ROWS:
        step = for_other_ranks(build_host_batch(decode_step(rows), BLOCK))
        if rank == 0:
            pickled = median_s(lambda: pickle.loads(pickle.dumps(step, pickle.HIGHEST_PROTOCOL)))
            over_gloo = median_s(lambda: (gloo.send(step), reply_over_gloo(b"")))
            over_shm = median_s(lambda: (mine.send(step), theirs.recv()))
            row = {"rows": rows, "pickled KiB": len(pickle.dumps(step)) / 1024, "pickle + unpickle us": pickled * 1e6}
            results.put({**row, "gloo round trip us": over_gloo * 1e6, "shm round trip us": over_shm * 1e6})
        else:
            median_s(lambda: (gloo.recv(), reply_over_gloo(b".")))
            median_s(lambda: (theirs.recv(), mine.send(b".")))
    dist.barrier()
    theirs.close()
    mine.close()
    dist.destroy_process_group()


def reply_over_gloo(payload: bytes) -> None:
    dist.broadcast_object_list([payload], src=1)


def median_s(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, init_method, results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    table_rows = [results.get() for _ in ROWS]
    for p in ranks:
        p.join()
    table = markdown_table(table_rows, list(table_rows[0]))
    write_results("step_broadcast", {"environment": environment(), "rows": table_rows}, table)
    print(table)


if __name__ == "__main__":
    main()
