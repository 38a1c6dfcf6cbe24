"""`pagellm generate` and `pagellm chat`, the terminal front doors, against the offline API: what they print is what
`LLM.generate` / `LLM.chat` return with the same sampling, which takes the flags given, then the model's
generation_config.json, then the CLI's own defaults (temperature 0.7, top_p 0.95, 256 tokens). And the CLI's errors
for bad flags and paths: a message naming them and exit status 2, before any model loads."""

from __future__ import annotations

import io

import pytest

from pagellm import LLM, SamplingParams
from pagellm.chat_repl import run_chat
from pagellm.cli import build_parser, main, sampling_params

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--quiet"]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(recommending_model_dir) -> LLM:
    return LLM(str(recommending_model_dir), device="cpu", dtype="float32", quiet=True)


def test_generate_uses_the_model_defaults_then_the_cli_defaults(recommending_model_dir, llm, capsys):
    assert main(["generate", "--model", str(recommending_model_dir), *ENGINE_FLAGS, "--prompt", PROMPT]) == 0
    # The file's greedy, repetition penalty and 4 tokens; the CLI's top_p (which greedy ignores).
    expected = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=4, top_p=0.95)
    assert capsys.readouterr().out == llm.generate([PROMPT], expected, use_tqdm=False)[0].outputs[0].text + "\n"


def test_generate_flags_win(recommending_model_dir, llm, capsys):
    flags = ["--temperature", "0", "--max-tokens", "7", "--generation-config", "vllm"]
    assert main(["generate", "--model", str(recommending_model_dir), *ENGINE_FLAGS, *flags, "--prompt", PROMPT]) == 0
    expected = SamplingParams(temperature=0.0, max_tokens=7, top_p=0.95)  # no file: no repetition penalty
    assert capsys.readouterr().out == llm.generate([PROMPT], expected, use_tqdm=False)[0].outputs[0].text + "\n"


def test_chat_streams_what_llm_chat_returns(recommending_model_dir, llm):
    args = build_parser().parse_args(["chat", "--model", str(recommending_model_dir), *ENGINE_FLAGS])
    params = sampling_params(args, llm.engine.default_sampling)
    out = io.StringIO()
    run_chat(llm, params, "Be brief.", stdin=io.StringIO("Hello there\n/reset\nHi\n\n"), stdout=out)
    # Each turn prints "you> " (the typed line is the terminal's echo, not printed), then "bot> " and the reply.
    replies = [line.split("bot> ", 1)[1] for line in out.getvalue().splitlines() if "bot> " in line]
    system = {"role": "system", "content": "Be brief."}
    expected = [
        llm.chat([system, {"role": "user", "content": text}], params, use_tqdm=False)[0].outputs[0].text
        for text in ("Hello there", "Hi")  # /reset: the second turn starts over
    ]
    assert replies == expected


@pytest.mark.parametrize("command", [["generate", "--prompt", PROMPT], ["chat"]])
def test_a_bad_sampling_flag_fails_before_the_model_loads(command, tmp_path, capsys):
    # No model at that path: the error is the flag's, so nothing was loaded first.
    assert main([*command, "--model", str(tmp_path / "absent"), *ENGINE_FLAGS, "--top-p", "2"]) == 2
    assert capsys.readouterr().err == "error: top_p=2.0 is invalid: must be in (0, 1]\n"


@pytest.mark.parametrize("port", ["65536", "-1", "http"])
def test_serve_refuses_a_port_that_is_none(port, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--port", port])
    assert exit_info.value.code == 2
    assert f"argument --port: '{port}' is not a TCP port: must be an integer in [0, 65535]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,missing",
    [
        (["convert", "--gguf", "{tmp}/absent.gguf", "--output", "{tmp}/out"], "{tmp}/absent.gguf"),
        (["quantize", "{tmp}/absent", "{tmp}/out", "--method", "awq"], "{tmp}/absent/config.json"),
    ],
)
def test_a_missing_input_path_is_an_error_naming_it(command, missing, tmp_path, capsys):
    assert main([part.format(tmp=tmp_path) for part in command]) == 2
    assert capsys.readouterr().err == f"error: {missing.format(tmp=tmp_path)}: No such file or directory\n"
