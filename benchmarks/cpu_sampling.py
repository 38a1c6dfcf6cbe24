"""CPU top-p sampling, same-run A/B of two versions of pagellm: the sampler alone (`reference.sample_rows`, which the
CPU path runs, on SmolLM2's vocabulary) and the embedded SmolLM2-135M decoding a batch of 64 at temperature 0.8,
top-p 0.95, each version in a fresh process, in the order A B B A.

    git archive HEAD~1 pagellm | tar x -C /tmp/base      # the baseline's package
    python benchmarks/cpu_sampling.py --baseline /tmp/base --label-a HEAD~1 --label-b HEAD
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

# One process: both measures with the pagellm found first on sys.path (argv[1]), printed as JSON.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from pagellm import LLM, SamplingParams
from pagellm.kernels import reference
from pagellm.model.loader import default_model

result = {}
gen = torch.Generator().manual_seed(0)
for batch in (16, 64):
    logits = torch.randn(batch, 49152, generator=gen) * 3
    args = (torch.full((batch,), 1 / 0.8), torch.zeros(batch, dtype=torch.int32), torch.full((batch,), 0.95),
            torch.randint(0, 2**62, (batch,), generator=gen))
    reference.sample_rows(logits, *args)
    start = time.perf_counter()
    for _ in range(10):
        reference.sample_rows(logits, *args)
    result[f"sampler_b{batch}_ms"] = (time.perf_counter() - start) / 10 * 1e3
llm = LLM(default_model(), quiet=True, max_model_len=2048)
prompts = [torch.randint(0, 30000, (32,), generator=gen).tolist() for _ in range(64)]
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, ignore_eos=True, seed=1)
llm.generate(prompts[:2], params, use_tqdm=False)
start = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
result["decode_b64_tok_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
result["tokens_of_row_0"] = outs[0].outputs[0].token_ids
print(json.dumps(result))
"""


def measure(package_root: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(package_root)], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, required=True, help="a directory holding the baseline's pagellm/")
    parser.add_argument("--label-a", default="baseline")
    parser.add_argument("--label-b", default="this tree")
    args = parser.parse_args()
    versions = {args.label_a: args.baseline, args.label_b: ROOT}
    runs = [(label, measure(versions[label])) for label in (args.label_a, args.label_b, args.label_b, args.label_a)]
    same_tokens = len({json.dumps(r["tokens_of_row_0"]) for _, r in runs}) == 1
    figures = ["sampler_b16_ms", "sampler_b64_ms", "decode_b64_tok_per_s"]
    rows = [
        {"version": label, **{f: statistics.median(r[f] for who, r in runs if who == label) for f in figures}}
        for label in versions
    ]
    env = environment()
    header = ", ".join(f"{k} {v}" for k, v in env.items())
    table = (
        f"# cpu-sampling ({env['date'][:10]})\n\n{header}\n\n"
        "`benchmarks/cpu_sampling.py`: the CPU sampler alone (`reference.sample_rows`, temperature 0.8, top-p 0.95, "
        "SmolLM2's 49,152 tokens, logits N(0, 9)) and the embedded SmolLM2-135M (fp32) decoding 64 rows of 32 prompt "
        f"tokens, 48 new tokens each; medians of two fresh processes per version (A B B A). "
        f"Seeded tokens identical across all runs: {same_tokens}.\n\n" + markdown_table(rows, ["version", *figures])
    )
    write_results("cpu-sampling", {"environment": env, "runs": runs, "medians": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
