"""Host time of the output side per decode step: `OutputProcessor.process` of one step's tokens for a batch of
requests, for each output kind (a streamed request's output rebuilt at every step, against a whole response's only
when it finishes), on SmolLM2's tokenizer (the embedded GGUF's). The engine thread spends this on every step, beside
the device's work: under load it is a share of the step's host time.

    python benchmarks/output_processing.py            # batches 16 and 64, 256 tokens a request
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm.core.step import RequestUpdate  # noqa: E402
from pagellm.engine.input_processor import ProcessedRequest, SampleRequest  # noqa: E402
from pagellm.engine.output_processor import OutputProcessor  # noqa: E402
from pagellm.model.loader import default_model  # noqa: E402
from pagellm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from pagellm.tokenizer import Tokenizer  # noqa: E402


def ms_per_step(tokenizer: Tokenizer, kind: RequestOutputKind, batch: int, steps: int, seed: int) -> float:
    """Mean ms of one step's `process` over `steps` steps of `batch` requests (random token ids, 40-token prompts)."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=steps, output_kind=kind)
    for i in range(batch):
        sample = SampleRequest(f"r{i}", 0, params, steps)
        processor.add_request(ProcessedRequest(f"r{i}", None, list(range(100, 140)), [sample]))
    tokens = torch.randint(200, 40_000, (steps, batch), generator=torch.Generator().manual_seed(seed)).tolist()
    elapsed = 0.0
    for step in range(steps):
        finish = "length" if step == steps - 1 else None
        updates = [RequestUpdate(f"r{i}", new_token_id=tokens[step][i], finish_reason=finish) for i in range(batch)]
        start = time.perf_counter()
        processor.process(updates)
        elapsed += time.perf_counter() - start
    return 1e3 * elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=256, help="tokens each request generates")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each kind, interleaved; medians reported")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir, gguf = os.path.split(default_model())
    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf))
    kinds = {"stream (CUMULATIVE)": RequestOutputKind.CUMULATIVE, "whole (FINAL_ONLY)": RequestOutputKind.FINAL_ONLY}
    rows = []
    for batch in args.batches:
        runs: dict[str, list[float]] = {name: [] for name in kinds}
        for repeat in range(args.repeats):
            for name, kind in kinds.items():
                runs[name].append(ms_per_step(tokenizer, kind, batch, args.steps, seed=repeat))
        rows.append({"batch": batch} | {f"{name} ms/step": round(statistics.median(v), 4) for name, v in runs.items()})
    table = markdown_table(rows, list(rows[0]))
    path = write_results(
        "output-processing-cpu", {"environment": environment(), "args": vars(args), "rows": rows}, table
    )
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
