"""Completions and chat completions on top of AsyncLLM: run the requests, shape OpenAI responses and SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from pagellm.engine.async_llm import AsyncLLM
from pagellm.errors import InvalidParameter
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.server.metrics import ServerMetrics
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest

IsDisconnected = Callable[[], Awaitable[bool]]


@dataclass
class Job:
    """One API call: its validated prompts (n samples each, by `params`) and how to render them."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]  # token ids, validated
    params: SamplingParams
    prompt_texts: list[str]  # for echo (completions)
    echo: bool = False
    include_usage: bool = False
    top_logprobs: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.id


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, model_name: str, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics

    # ---- building jobs (validation happens here, before anything runs) --------------------------------------

    def completion_job(self, req: CompletionRequest) -> Job:
        params = req.to_sampling_params()
        prompts = req.prompts()
        ids = [self.llm.input_processor.tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else self._decode(p) for p in prompts]
        return Job(
            "completion",
            self.model_name,
            ids,
            params,
            texts,
            echo=req.echo,
            include_usage=req.include_usage,
            top_logprobs=params.logprobs or 0,
        )

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise InvalidParameter("messages", "messages: this model has no tokenizer, so no chat template")
        ids = tokenizer.chat_prompt_ids(
            req.conversation(), req.add_generation_prompt, **(req.chat_template_kwargs or {})
        )
        params = req.to_sampling_params()
        return Job(
            "chat",
            self.model_name,
            [self.llm.input_processor.tokenize(ids)],
            params,
            [""],
            include_usage=req.include_usage,
            top_logprobs=params.logprobs or 0,
        )

    def _decode(self, ids: list[int]) -> str:
        return "" if self.llm.tokenizer is None else self.llm.tokenizer.decode(ids)

    # ---- running --------------------------------------------------------------------------------------------

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt of the job as they come, tagged with the prompt's index. Leaving early
        cancels the producers, whose streams then abort their requests."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, prompt: list[int]) -> None:
            try:
                async for out in self.llm.generate(prompt, job.params):
                    await queue.put((index, out))
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, prompt)) for i, prompt in enumerate(job.prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item[1].finished:
                    remaining -= 1
                    self.metrics.record_finished(item[1])
                yield item
        finally:
            for task in tasks:
                task.cancel()

    async def run(self, job: Job, is_disconnected: IsDisconnected) -> dict | None:
        """The whole response, or None if the client left first (its requests are then aborted)."""
        finals: dict[int, RequestOutput] = {}

        async def collect() -> None:
            async for index, out in self._merged(job):
                if out.finished:
                    finals[index] = out

        task = asyncio.create_task(collect())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await is_disconnected():
                task.cancel()
                return None
        task.result()
        outputs = [finals[i] for i in range(len(job.prompts))]
        choices = [self._choice(job, i, out, c) for i, out in enumerate(outputs) for c in out.outputs]
        return {
            "id": job.response_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": _usage(outputs),
        }

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: one chunk per new text piece of each choice, a final usage chunk if asked, [DONE]."""
        sent: dict[int, int] = {}  # choice index -> characters sent
        logprobs_sent: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        if job.kind == "chat":
            for i in range(len(job.prompts) * job.n):
                yield _sse(
                    self._chunk(
                        job,
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    )
                )
        async for prompt_index, out in self._merged(job):
            if out.finished:
                finals[prompt_index] = out
            choices = []
            for c in out.outputs:
                index = prompt_index * job.n + c.index
                start = sent.get(index)
                if start is None:
                    start = 0
                    if job.echo:
                        choices.append(self._stream_choice(job, index, job.prompt_texts[prompt_index], None, None))
                delta = c.text[start:]
                first_lp = logprobs_sent.get(index, 0)
                new_logprobs = c.logprobs[first_lp:] if c.logprobs is not None else None
                if delta or c.finished or new_logprobs:
                    sent[index] = len(c.text)
                    logprobs_sent[index] = len(c.logprobs or [])
                    lp = (
                        None
                        if new_logprobs is None
                        else self._logprobs(job, new_logprobs, c.token_ids[first_lp:], start)
                    )
                    choices.append(self._stream_choice(job, index, delta, lp, c.finish_reason))
            if choices:
                yield _sse(self._chunk(job, choices))
        if job.include_usage:
            outputs = [finals[i] for i in sorted(finals)]
            yield _sse({**self._chunk(job, []), "usage": _usage(outputs)})
        yield "data: [DONE]\n\n"

    # ---- shaping --------------------------------------------------------------------------------------------

    def _chunk(self, job: Job, choices: list[dict]) -> dict:
        kind = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        return {"id": job.response_id, "object": kind, "created": job.created, "model": job.model, "choices": choices}

    def _stream_choice(self, job: Job, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        if job.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _choice(self, job: Job, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        index = prompt_index * job.n + c.index
        logprobs = None if c.logprobs is None else self._logprobs(job, c.logprobs, c.token_ids, 0)
        if job.kind == "completion":
            text = (job.prompt_texts[prompt_index] if job.echo else "") + c.text
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        return {
            "index": index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _logprobs(self, job: Job, positions: list[PositionLogprobs], token_ids: list[int], text_offset: int) -> dict:
        """OpenAI logprobs of generated tokens: `content` entries for chat, the legacy arrays for completions."""

        def text(token_id: int, entry: PositionLogprobs) -> str:
            decoded = entry[token_id].decoded_token
            return decoded if decoded is not None else str(token_id)

        if job.kind == "chat":
            content = []
            for tid, entry in zip(token_ids, positions):
                top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= job.top_logprobs)
                content.append(
                    {
                        "token": text(tid, entry),
                        "logprob": entry[tid].logprob,
                        "bytes": list(text(tid, entry).encode()),
                        "top_logprobs": [
                            {
                                "token": text(t, entry),
                                "logprob": entry[t].logprob,
                                "bytes": list(text(t, entry).encode()),
                            }
                            for _, t in top
                        ],
                    }
                )
            return {"content": content}
        tokens, offsets = [text(tid, e) for tid, e in zip(token_ids, positions)], []
        for tok in tokens:
            offsets.append(text_offset)
            text_offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [e[t].logprob for t, e in zip(token_ids, positions)],
            "top_logprobs": [{text(t, e): lp.logprob for t, lp in e.items()} for e in positions],
            "text_offset": offsets,
        }


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
