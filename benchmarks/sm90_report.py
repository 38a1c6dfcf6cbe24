"""What the paged decode or prefill attention kernel, or the quantized-weight matmul, becomes on the H100/H200
(sm_90), compiled on this machine, no GPU needed: registers, spilled bytes, shared memory, programs resident per
SM, and the instruction mix of its main loop (barriers included). GPU time is scarce; this shows before a device
call whether a tile, warp or pipeline change can pay.

    python benchmarks/sm90_report.py --int8 --batch 16 --context 16384 --block-n 128 --warps 4 --stages 2
    python benchmarks/sm90_report.py --prefill 16 --batch 14 --context 574
    python benchmarks/sm90_report.py --quant int4 --rows 1 --shape 28672 4096 --tiles 1 16 1024 4 2

Launches are intercepted and compiled with Triton's own specialization of their arguments (CPU tensors stand in
for the caches), for sm_90 with the bundled ptxas; cuobjdump reads the result. Not under TRITON_INTERPRET=1, which
turns the kernels into interpreted functions.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from unittest import mock

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pagellm.kernels.decode_attention as decode_attention  # noqa: E402
import pagellm.kernels.prefill_attention as prefill_attention  # noqa: E402
import pagellm.kernels.quant_matmul as quant_matmul  # noqa: E402
from pagellm.model.attention import allocate_kv_caches  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM, SHARED_PER_SM, MAX_WARPS_PER_SM = 65536, 228 * 1024, 64
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_for_sm90(kernel: JITFunction, args: tuple, kwargs: dict) -> triton.compiler.CompiledKernel:
    """Compile one launch as the runtime would: its integer and pointer arguments specialized (1 as a constant,
    multiples of 16 as divisible) by Triton's own rules."""
    from triton._C.libtriton import native_specialize_impl

    options = {k: kwargs.pop(k) for k in list(kwargs) if k in ("num_warps", "num_stages", "maxnreg", "launch_pdl")}
    bound = kernel.signature.bind(*args, **kwargs)
    signature, constants, attrs = {}, {}, {}
    for i, (param, (name, value)) in enumerate(zip(kernel.params, bound.arguments.items())):
        if param.is_constexpr:
            signature[name], constants[(i,)] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(
            BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        signature[name] = "fp32" if isinstance(value, float) else kind
        if kind == "constexpr":
            constants[(i,)] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=SM90, options=options)


def cuobjdump(compiled, flag: str) -> str:
    """cuobjdump's output for the kernel's cubin (`-sass`: the machine code, `-res-usage`: its resources)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([CUOBJDUMP, flag, cubin.name], capture_output=True, text=True, check=True).stdout


def resources(compiled) -> dict[str, int]:
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(compiled, "-res-usage")).groups()
    return {"registers": int(registers), "spilled_bytes": int(stack), "shared_bytes": compiled.metadata.shared}


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    by_registers = REGISTERS_PER_SM // (-(-registers * 32 // 256) * 256 * warps)  # allocated per warp, by 256
    return min(by_registers, SHARED_PER_SM // (shared + 1024), MAX_WARPS_PER_SM // warps)


def main_loop_mix(listing: str) -> collections.Counter:
    """Opcode counts of the longest backward branch's body (per thread, one iteration)."""
    code = {int(a, 16): op for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", listing)}
    loops = [
        (int(m.group(1), 16), addr)
        for addr, op in code.items()
        if (m := re.search(r"BRA (0x[0-9a-f]+)", op)) and int(m.group(1), 16) < addr
    ]
    if not loops:
        return collections.Counter()
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = [op for addr, op in code.items() if start <= addr <= end]
    return collections.Counter(op.split()[1 if op.startswith("@") else 0].split(".")[0] for op in body)


def loop_report(compiled, warps: int) -> dict:
    """Resources, occupancy and the main loop's instruction mix of one compiled kernel."""
    report = resources(compiled)
    mix = main_loop_mix(cuobjdump(compiled, "-sass"))
    report.update(
        programs_per_sm=programs_per_sm(report["registers"], warps, report["shared_bytes"]),
        loop_instructions=sum(mix.values()),
        loop_mix=dict(mix.most_common()),
    )
    return report


def first_launch(module: ModuleType, launch: Callable[[], object]) -> tuple[triton.compiler.CompiledKernel, int]:
    """The first kernel `launch()` runs, compiled for sm_90 instead of run, and its warps: the launcher as it runs on
    the GPU, with `module`'s inline-PTX conversions on."""
    launches = []

    def intercept(self, *args, grid, warmup, **kwargs):
        launches.append((compile_for_sm90(self, args, kwargs), kwargs.get("num_warps", 4)))

    with (
        mock.patch.object(JITFunction, "run", intercept),
        mock.patch.object(module, "asm_conversions", lambda x: True),
    ):
        launch()
    return launches[0]


def decode_report(
    batch: int,
    context: int,
    int8: bool,
    block_n: int | None,
    warps: int,
    stages: int,
    split: int | None,
    new_tokens: bool = False,
) -> dict:
    block = 16
    kv_dtype = torch.int8 if int8 else torch.bfloat16
    cache = allocate_kv_caches(1, 64, block, 8, 128, kv_dtype, torch.device("cpu"))[0]
    q = torch.zeros(batch, 32, 128, dtype=torch.bfloat16)
    tables = torch.zeros(batch, context // block, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    tile = block_n or decode_attention.decode_tile(int8, batch, block)
    # The engine's split, rounded up to a multiple of a tile given here.
    split = split or -(-decode_attention.split_size_for(context, batch, int8, block) // tile) * tile
    new = None
    if new_tokens:  # a pure-decode step's variant: RoPE (with Qwen3's norms) and the KV write inside
        rows = torch.zeros(batch, 8, 128, dtype=torch.bfloat16)
        positions, norm = torch.zeros(batch, dtype=torch.int64), torch.ones(128, dtype=torch.bfloat16)
        cos_sin = torch.zeros(context, 128)
        new = decode_attention.NewTokens(rows, rows, positions, positions, cos_sin, norm, norm, 1e-6)
    partial = first_launch(
        decode_attention,
        lambda: decode_attention.paged_decode_attention(
            q,
            cache.key,
            cache.value,
            tables,
            lens,
            128**-0.5,
            context,
            split,
            cache.key_scale,
            cache.value_scale,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
            new_tokens=new,
        ),
    )
    report = loop_report(*partial)
    report.update(
        tile=tile, split=split, warp_instructions_per_token=round(report["loop_instructions"] * warps / tile, 1)
    )
    return report


def prefill_report(heads: int, batch: int, query: int, int8: bool) -> dict:
    """The prefill attention kernel for `batch` whole prompts of `query` tokens, `heads` query heads over 8 KV heads
    of 128, cache blocks of 16."""
    block = 16
    kv_dtype = torch.int8 if int8 else torch.bfloat16
    cache = allocate_kv_caches(1, 64, block, 8, 128, kv_dtype, torch.device("cpu"))[0]
    q = torch.zeros(batch * query, heads, 128, dtype=torch.bfloat16)
    tables = torch.zeros(batch, -(-query // block), dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32) * query
    lens = torch.full((batch,), query, dtype=torch.int32)
    return loop_report(
        *first_launch(
            prefill_attention,
            lambda: prefill_attention.paged_prefill_attention(
                q, cache.key, cache.value, tables, starts, lens, 128**-0.5, query, cache.key_scale, cache.value_scale
            ),
        )
    )


def quant_report(fmt: str, rows: int, n: int, k: int, tiles: quant_matmul.Tiles | None) -> dict:
    """`weight_only_matmul`'s first launch for `rows` activation rows on an [n, k] weight (INT4 in groups of 128,
    or FP8), with `tiles` or the default ones."""
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    if fmt == "int4":
        weight, scales = torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 128, dtype=torch.float16)
        stored = (weight, scales, scales, 4, 128)
    else:
        stored = (torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.zeros(n), None, 8, 0)
    compiled, warps = first_launch(quant_matmul, lambda: quant_matmul.weight_only_matmul(x, *stored, tiles=tiles))
    report = loop_report(compiled, warps)
    report.update(
        layout_conversions=compiled.asm["ttgir"].count("ttg.convert_layout"),
        loop_barriers=report["loop_mix"].get("BAR", 0),
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--block-n", type=int)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--split", type=int)
    parser.add_argument("--new-tokens", action="store_true", help="the pure-decode variant (RoPE and KV write inside)")
    parser.add_argument("--quant", choices=["int4", "fp8"], help="report the quantized-weight matmul instead")
    parser.add_argument("--prefill", type=int, metavar="HEADS", help="report prefill attention (query heads) instead")
    parser.add_argument("--rows", type=int, default=1, help="--quant: activation rows")
    parser.add_argument("--shape", type=int, nargs=2, default=[6144, 4096], metavar=("N", "K"), help="--quant")
    parser.add_argument("--tiles", type=int, nargs="+", help="--quant: Tiles' fields (default: matmul_tiles)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args()
    if args.prefill:
        report = prefill_report(args.prefill, args.batch, args.context, args.int8)
    elif args.quant:
        tiles = quant_matmul.Tiles(*args.tiles) if args.tiles else None
        report = quant_report(args.quant, args.rows, *args.shape, tiles)
    else:
        report = decode_report(
            args.batch, args.context, args.int8, args.block_n, args.warps, args.stages, args.split, args.new_tokens
        )
    if args.json:
        print(json.dumps(report))
        return
    report["loop_mix"] = dict(list(report["loop_mix"].items())[:12])
    for key, value in report.items():
        print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
