"""The `pagellm` command: generate | chat | serve | worker | train | convert | quantize."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from pagellm.config import EngineConfig
from pagellm.sampling_params import SamplingParams
from pagellm.server.tool_parsers import REASONING_PARSERS, TOOL_PARSERS

# Python types of EngineConfig's annotations (strings under `from __future__ import annotations`).
_ARG_TYPES = {"str": str, "str | None": str, "int": int, "int | None": int, "float": float}


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--max-num-seqs` for max_num_seqs), with its default and help; booleans
    get a `--no-` form too."""
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        flags = [f"--{f.name.replace('_', '-')}", *f.metadata["aliases"]]
        if f.type == "bool":
            group.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
            )
        else:
            group.add_argument(
                *flags,
                dest=f.name,
                type=_ARG_TYPES[f.type],
                default=f.default,
                choices=f.metadata["choices"],
                help=f.metadata["help"],
            )


# generate's and chat's own sampling defaults, for what neither a flag nor the model's generation_config.json sets.
CLI_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "top_k": 0}


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    for name, default in CLI_SAMPLING_DEFAULTS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=None,
            help=f"default: the model's generation_config.json, else {default}",
        )
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: must be an integer in [0, 65535]")
    return int(text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def sampling_params(args: argparse.Namespace, model_defaults: Mapping[str, Any]) -> SamplingParams:
    """The sampling flags given, then the model's defaults (`generation_config`), then CLI_SAMPLING_DEFAULTS."""
    flags = {name: getattr(args, name) for name in CLI_SAMPLING_DEFAULTS if getattr(args, name) is not None}
    return SamplingParams(**{**CLI_SAMPLING_DEFAULTS, **model_defaults, **flags}, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> None:
    from pagellm import LLM

    sampling_params(args, {})  # a bad flag fails now, not after the model has loaded
    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(args.prompt, sampling_params(args, llm.engine.default_sampling), use_tqdm=not args.quiet)
    for out in outputs:
        print(out.outputs[0].text if len(args.prompt) == 1 else f"--- {out.prompt!r}\n{out.outputs[0].text}")


def cmd_chat(args: argparse.Namespace) -> None:
    from pagellm import LLM
    from pagellm.chat_repl import run_chat

    sampling_params(args, {})  # a bad flag fails now, not after the model has loaded
    llm = LLM(**engine_kwargs(args))
    run_chat(llm, sampling_params(args, llm.engine.default_sampling), args.system)


def served_model_name(model: str | None) -> str:
    """The name clients use: the hub id as given, else the file or directory name."""
    from pathlib import Path

    from pagellm.model.loader import default_model

    path = Path(model or default_model())
    if path.exists():
        return path.stem.split(".")[0] if path.suffix == ".gguf" else path.name
    return str(model)


def _json_list(text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError('must be a JSON list of strings, like ["*"]')
    return value


def cmd_quantize(args: argparse.Namespace) -> None:
    from pagellm.quantization.quantize import quantize_model

    out = quantize_model(
        args.model,
        args.output,
        args.method,
        args.bits,
        args.group_size,
        args.calibration,
        symmetric=not args.asymmetric,
        quiet=args.quiet,
    )
    print(f"wrote {out}")


def cmd_worker(args: argparse.Namespace) -> None:
    from pagellm.distributed.executor import run_torchrun_worker

    run_torchrun_worker(EngineConfig(**engine_kwargs(args)))


def cmd_serve(args: argparse.Namespace) -> None:
    import os

    import uvicorn

    from pagellm.distributed.executor import launched_by_torchrun

    if launched_by_torchrun() and int(os.environ["RANK"]) > 0:  # `torchrun ... serve`: rank 0 serves, the rest work
        cmd_worker(args)
        return

    from pagellm.config import EngineConfig
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.server.app import create_app

    llm = AsyncLLM(EngineConfig(**engine_kwargs(args)))
    name = args.served_model_name or served_model_name(args.model)
    app = create_app(
        llm,
        name,
        api_key=args.api_key or os.environ.get("PAGELLM_API_KEY"),
        max_body_bytes=args.max_body_bytes,
        allowed_origins=args.allowed_origins,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    url = f"http://{args.host}:{args.port}"
    print(f"pagellm: serving {name} — demo page {url}/ — OpenAI API {url}/v1", flush=True)
    if llm.default_sampling:
        print(f"pagellm: the model's sampling defaults {llm.default_sampling} (--generation-config vllm: none)")
    try:
        # On SIGTERM uvicorn stops accepting, waits up to the timeout for running requests, then cancels them
        # (which aborts them in the engine).
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    finally:
        llm.shutdown()


def cmd_train(args: argparse.Namespace) -> None:
    from pagellm.training.train import TrainConfig, Trainer

    cfg = TrainConfig(
        data=args.data,
        output=args.output,
        preset=args.preset,
        max_steps=args.max_steps,
        vocab_size=args.vocab_size,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        device=args.device,
        quiet=args.quiet,
    )
    history = Trainer(cfg, resume=args.resume).train()
    print(
        f"validation loss {history['val'][0][1]:.3f} -> {history['val'][-1][1]:.3f}, "
        f"{history['tokens_per_second']:,.0f} training tokens/s; model in {args.output} "
        f"(loss curve: {args.output}/loss.png)"
    )


def cmd_convert(args: argparse.Namespace) -> None:
    if (args.checkpoint is None) == (args.gguf is None):
        raise ValueError("convert: give exactly one of --checkpoint and --gguf")
    if args.checkpoint is not None:
        from pagellm.training.export import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.output)
    else:
        from pagellm.model.gguf_convert import convert_gguf

        out = convert_gguf(args.gguf, args.output, quiet=args.quiet)
    print(f"HF model directory: {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: paged-KV LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the text")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible server with a demo page")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or PAGELLM_API_KEY)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    serve.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        help='CORS: origins allowed to call the API from a browser, as a JSON list (default ["*"])',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls (hermes: Qwen2.5/Qwen3; llama3_json: Llama 3.1+; pythonic); "
        "enables tool_choice='auto'",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> into message.reasoning_content (qwen3)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="seconds that SIGTERM waits for running requests to finish before aborting them (default 0: abort)",
    )
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser(
        "worker", help="a tensor-parallel rank other than 0 under torchrun (env://), serving rank 0's engine"
    )
    _add_engine_args(worker)
    worker.set_defaults(func=cmd_worker)

    train = sub.add_parser("train", help="train a tokenizer and a small Llama on TinyStories-format text")
    train.add_argument("--data", required=True, help=".txt (<|endoftext|>-separated), .json, .jsonl, .parquet or a dir")
    train.add_argument("--output", required=True, help="output directory (an HF checkpoint + checkpoint.pt)")
    train.add_argument("--preset", default="tiny", choices=["tiny", "15m", "110m"])
    train.add_argument("--max-steps", type=int, default=1000)
    train.add_argument("--vocab-size", type=int, default=None)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--warmup-steps", type=int, default=50)
    train.add_argument("--eval-every", type=int, default=100)
    train.add_argument("--save-every", type=int, default=200)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default=None)
    train.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint.pt")
    train.add_argument("--quiet", action="store_true")
    train.set_defaults(func=cmd_train)

    convert = sub.add_parser("convert", help="training checkpoint or GGUF file -> HF model directory")
    convert.add_argument("--checkpoint", default=None, help="checkpoint.pt or the training output directory")
    convert.add_argument("--gguf", default=None, help="a .gguf file")
    convert.add_argument("--output", required=True)
    convert.add_argument("--quiet", action="store_true")
    convert.set_defaults(func=cmd_convert)

    quantize = sub.add_parser(
        "quantize", help="full-precision HF model directory -> AWQ, GPTQ or FP8 checkpoint (round to nearest)"
    )
    quantize.add_argument("model", help="an HF model directory with full-precision safetensors")
    quantize.add_argument("output", help="the quantized checkpoint's directory")
    quantize.add_argument("--method", required=True, choices=["awq", "gptq", "fp8"])
    quantize.add_argument("--bits", type=int, default=4, help="AWQ: 4; GPTQ: 4 or 8")
    quantize.add_argument("--group-size", type=int, default=128, help="input columns per scale (AWQ, GPTQ)")
    quantize.add_argument(
        "--calibration",
        default=None,
        help="a text file: AWQ searches activation-aware scales on it, GPTQ compensates rounding errors on it "
        "(else plain round-to-nearest)",
    )
    quantize.add_argument(
        "--asymmetric", action="store_true", help="GPTQ: zero points per group (gptq_v2 format) instead of 2**(bits-1)"
    )
    quantize.add_argument("--quiet", action="store_true")
    quantize.set_defaults(func=cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path given that is not there (or not readable, or a port in use)
        print(f"error: {exc.filename}: {exc.strerror}" if exc.filename else f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
