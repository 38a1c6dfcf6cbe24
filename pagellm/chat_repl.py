"""`pagellm chat`: a terminal conversation that streams tokens as the engine produces them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

from pagellm.engine.llm import LLM
from pagellm.sampling_params import SamplingParams


def stream_reply(llm: LLM, messages: list[dict[str, Any]], params: SamplingParams) -> Iterator[str]:
    """Yield the assistant's reply piece by piece; aborts the request if the consumer stops early."""
    engine = llm.engine
    request_id = engine.add_request(llm.chat_prompt_ids(messages), params)
    shown = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                text = out.outputs[0].text
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
                if out.finished:
                    return
    finally:
        engine.abort(request_id)


def run_chat(
    llm: LLM,
    params: SamplingParams,
    system: str | None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    stdout.write("pagellm chat — empty line or Ctrl-D to quit, /reset to start over\n")
    while True:
        stdout.write("\nyou> ")
        stdout.flush()
        line = stdin.readline()
        if not line.strip():
            return
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        stdout.write("bot> ")
        reply = ""
        try:
            for piece in stream_reply(llm, messages, params):
                reply += piece
                stdout.write(piece)
                stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
