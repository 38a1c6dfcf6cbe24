"""Completions and chat completions on top of AsyncLLM: run the requests, shape OpenAI responses and SSE chunks."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.beam_search import BeamSearchParams, round_params, search_rounds
from pagellm.engine.input_processor import ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.chat_output import ChatOutputRules, chat_output_rules, finished_calls
from pagellm.server.metrics import ServerMetrics
from pagellm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, template_messages
from pagellm.server.tool_parsers import PartialCall, ToolCall

ClientGone = Callable[[], Awaitable[None]]  # returns once the client has hung up


@dataclass
class Job:
    """One API call: its validated requests (one per prompt, n samples each) and how to render them."""

    kind: str  # "completion" or "chat"
    model: str
    requests: list[ProcessedRequest]
    params: SamplingParams
    prompt_texts: list[str]  # for echo (completions)
    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens=0: the drawn token is not returned
    return_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field
    include_usage: bool = False
    continuous_usage: bool = False  # every streamed chunk carries its choice's usage so far
    top_logprobs: int = 0
    chat_rules: ChatOutputRules = field(default_factory=ChatOutputRules)
    beam: BeamSearchParams | None = None  # `use_beam_search`: the choices are the n best hypotheses
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def response_id(self) -> str:
        return ("cmpl-" if self.kind == "completion" else "chatcmpl-") + self.id


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        metrics: ServerMetrics,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    # ---- building jobs: validation, tokenization, the chat template, grammars (slow for long inputs: the app
    # runs these on a worker thread, off the event loop). Everything a request can get wrong is found here. ------

    def completion_job(self, req: CompletionRequest) -> Job:
        params = req.to_sampling_params(self.llm.default_sampling)
        beam = req.beam_search_params(params, self.llm.max_model_len)
        prompts = req.prompts()
        ids = [self.llm.input_processor.tokenize(p, params.truncate_prompt_tokens) for p in prompts]
        if not req.prompt_only:
            for prompt_ids in ids:
                self._check_context_length(len(prompt_ids), req.max_tokens, "prompt")
        # echo returns the prompt the model read: what truncate_prompt_tokens left of it
        whole = params.truncate_prompt_tokens is None
        texts = [p if isinstance(p, str) and whole else self._decode(i) for p, i in zip(prompts, ids)]
        job_id = uuid.uuid4().hex
        return Job(
            "completion",
            self.model_name,
            self._process(job_id, ids, params, req.requested_structure()),
            params,
            texts,
            echo=req.echo,
            prompt_only=req.prompt_only,
            return_prompt_logprobs=req.prompt_logprobs is not None,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            top_logprobs=params.logprobs or 0,
            beam=beam,
            id=job_id,
        )

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        rules, forced = chat_output_rules(req, self.tool_call_parser, self.reasoning_parser)
        structure = req.requested_structure()
        if structure is not None and forced is not None:
            raise InvalidParameter(
                structure[0], f"{structure[0]}: cannot be combined with tool_choice={req.tool_choice}"
            )
        if forced is not None:
            structure = ("tool_choice", forced)
        params = req.to_sampling_params(structure and structure[1], self.llm.default_sampling)
        beam = req.beam_search_params(params, self.llm.max_model_len)
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        ids = self.llm.input_processor.tokenize(
            self.chat_prompt_ids(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools, req.continue_final_message
            ),
            params.truncate_prompt_tokens,
        )
        self._check_context_length(len(ids), req.requested_max_tokens, "messages")
        job_id = uuid.uuid4().hex
        return Job(
            "chat",
            self.model_name,
            self._process(job_id, [ids], params, structure),
            params,
            [""],
            return_prompt_logprobs=req.prompt_logprobs is not None,
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            top_logprobs=params.logprobs or 0,
            chat_rules=rules,
            beam=beam,
            id=job_id,
        )

    def _process(
        self,
        job_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        structure: tuple[str, StructuredOutputsParams] | None,
    ) -> list[ProcessedRequest]:
        """The engine's validated requests; a grammar that does not compile is the fault of the field it came
        from."""
        try:
            return [self.llm.input_processor.process(ids, params, f"{job_id}-{i}") for i, ids in enumerate(prompts)]
        except InvalidParameter as exc:
            if structure is None or not exc.param.startswith("structured_outputs"):
                raise
            field_name = structure[0]
            raise InvalidParameter(field_name, f"{field_name}: {str(exc).split(': ', 1)[-1]}") from exc

    def chat_prompt_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise InvalidParameter("messages", "messages: this model has no tokenizer, so no chat template")
        return tokenizer.chat_prompt_ids(
            template_messages(messages), add_generation_prompt, template_kwargs, tools, continue_final_message
        )

    def _check_context_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_field: str) -> None:
        """A request for more tokens than fit is refused (vLLM's answer), not cut short."""
        limit = self.llm.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise InvalidParameter(
                "max_tokens",
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_field}, {max_tokens} "
                f"in the completion). Please reduce the length of the {prompt_field} or completion.",
            )

    def _decode(self, ids: list[int]) -> str:
        return "" if self.llm.tokenizer is None else self.llm.tokenizer.decode(ids)

    # ---- running --------------------------------------------------------------------------------------------

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt of the job as they come, tagged with the prompt's index. Leaving early
        cancels the producers, whose streams then abort their requests."""
        if job.beam is not None:  # the prompts' searches side by side, their outputs at the end
            searched = await asyncio.gather(*(self._beam_search(request, job.beam) for request in job.requests))
            for index, out in enumerate(searched):
                self.metrics.record_finished(out)
                yield index, out
            return
        if len(job.requests) == 1:  # the usual job: read its stream here, without a task and a queue between
            async with aclosing(self.llm.stream(job.requests[0])) as outputs:
                async for out in outputs:
                    if out.finished:
                        self.metrics.record_finished(out)
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, request: ProcessedRequest) -> None:
            try:
                async with aclosing(self.llm.stream(request)) as outputs:
                    async for out in outputs:
                        await queue.put((index, out))
            except Exception as exc:
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i, request)) for i, request in enumerate(job.requests)]
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

    async def _beam_search(self, request: ProcessedRequest, params: BeamSearchParams) -> RequestOutput:
        """The request's prompt searched with `params` (see engine/beam_search.py), its hypotheses as the samples
        of one output; every round's beams run as requests of their own, together."""
        prompt = request.prompt_token_ids
        eos = self.llm.input_processor.eos_token_ids
        rounds = search_rounds([prompt], params, eos, self.llm.max_model_len, self._decode)
        beam_params = round_params(params)

        async def final(ids: list[int], request_id: str) -> RequestOutput:
            async with aclosing(self.llm.generate(ids, beam_params, request_id)) as outputs:
                async for out in outputs:
                    if out.finished:
                        return out
            raise AssertionError("a request's stream ended before its final output")

        try:
            asked = next(rounds)
            for number in itertools.count():
                names = (f"{request.request_id}-beam{number}-{i}" for i in range(len(asked)))
                asked = rounds.send(list(await asyncio.gather(*map(final, asked, names))))
        except StopIteration as finished:
            hypotheses = finished.value[0].sequences
        samples = [
            CompletionOutput(
                index,
                h.text,
                h.tokens[len(prompt) :],
                h.finish_reason,
                cumulative_logprob=h.cum_logprob,
            )
            for index, h in enumerate(hypotheses)
        ]
        return RequestOutput(request.request_id, None, prompt, samples, finished=True)

    async def _finals(self, job: Job) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in self._merged(job):
            if out.finished:
                finals[index] = out
        return [finals[i] for i in range(len(job.requests))]

    async def run(self, job: Job, client_gone: ClientGone) -> dict | None:
        """The whole response, or None if the client hung up first: its requests are then aborted at once."""
        collect = asyncio.create_task(self._finals(job))
        gone = asyncio.create_task(client_gone())
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            for task in (collect, gone):
                task.cancel()
        if collect not in done:
            return None
        outputs = collect.result()
        choices = [self._choice(job, i, out, c) for i, out in enumerate(outputs) for c in out.outputs]
        response = {
            "id": job.response_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": _usage(job, outputs),
        }
        if job.kind == "chat" and job.return_prompt_logprobs:
            response["prompt_logprobs"] = _prompt_logprobs_field(outputs[0])
        return response

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: one chunk per new text piece of each choice (one choice per chunk, as OpenAI sends them),
        a final usage chunk if asked, [DONE]."""
        states: dict[int, _StreamState] = {}  # by choice index
        finals: dict[int, RequestOutput] = {}
        prompt_lengths = [len(r.prompt_token_ids) for r in job.requests]

        def chunk(choice: dict, completion_tokens: int = 0) -> str:
            payload = self._chunk(job, [choice])
            if job.continuous_usage:
                prompt = prompt_lengths[choice["index"] // job.n]
                payload["usage"] = _usage_counts(prompt, completion_tokens)
            return _sse(payload)

        if job.kind == "chat":
            for i in range(len(job.requests) * job.n):
                delta = {"role": "assistant", "content": ""}
                yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        async for prompt_index, out in self._merged(job):
            if out.finished:
                finals[prompt_index] = out
            for c in out.outputs:
                index = prompt_index * job.n + c.index
                state = states.get(index)
                if state is None:
                    state = states[index] = _StreamState()
                    if job.echo:
                        lp, state.offset = self._echo_logprobs(job, prompt_index, out)
                        echo = self._stream_choice(job, index, job.prompt_texts[prompt_index], lp, None)
                        yield chunk(echo)
                text, token_ids, positions = self._generated(job, c)
                new_positions = positions[state.positions_sent :] if positions is not None else None
                lp = None
                if new_positions:
                    lp = self._logprobs(job, new_positions, token_ids[state.positions_sent :], state.offset)
                    state.offset = _next_offset(lp, state.offset)
                    state.positions_sent = len(positions)
                choice = (
                    self._chat_stream_choice(job, index, c, state, lp)
                    if job.kind == "chat"
                    else self._completion_stream_choice(job, index, c, text, state, lp)
                )
                if choice is not None:
                    yield chunk(choice, 0 if job.prompt_only else len(c.token_ids))
        if job.include_usage:
            outputs = [finals[i] for i in sorted(finals)]
            yield _sse({**self._chunk(job, []), "usage": _usage(job, outputs)})
        yield "data: [DONE]\n\n"

    def _completion_stream_choice(
        self, job: Job, index: int, c: CompletionOutput, text: str, state: _StreamState, lp: dict | None
    ) -> dict | None:
        delta = text[len(state.content) :]
        if not (delta or c.finished or lp):
            return None
        state.content = text
        return self._stream_choice(job, index, delta, lp, _finish(job, c)[0])

    def _chat_stream_choice(
        self, job: Job, index: int, c: CompletionOutput, state: _StreamState, lp: dict | None
    ) -> dict | None:
        """The next chunk of a chat choice: new reasoning and content as far as they can be told apart from
        tool-call text; at the end, whatever was held back and the tool calls."""
        reasoning, content, calls = job.chat_rules.streaming(c.text)
        finish = c.finish_reason
        if c.finished:
            reply = job.chat_rules.final(c.text)
            reasoning, content = reply.reasoning or "", reply.content or ""
            calls = finished_calls(calls, reply.tool_calls) if reply.tool_calls else []
            finish = "tool_calls" if reply.tool_calls else finish
        delta: dict[str, Any] = {}
        if reasoning.startswith(state.reasoning) and len(reasoning) > len(state.reasoning):
            delta["reasoning_content"], state.reasoning = reasoning[len(state.reasoning) :], reasoning
        if content.startswith(state.content) and len(content) > len(state.content):
            delta["content"], state.content = content[len(state.content) :], content
        tool_deltas = _tool_call_deltas(calls, state.tool_calls)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        if not (delta or c.finished or lp):
            return None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    # ---- shaping --------------------------------------------------------------------------------------------

    def _chunk(self, job: Job, choices: list[dict]) -> dict:
        kind = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        return {"id": job.response_id, "object": kind, "created": job.created, "model": job.model, "choices": choices}

    def _stream_choice(self, job: Job, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        if job.kind == "completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def _generated(job: Job, c: CompletionOutput) -> tuple[str, list[int], list[PositionLogprobs | None] | None]:
        """What a choice returns of its sample: text, token ids, logprobs (nothing of it for the prompt alone)."""
        if job.prompt_only:
            return "", [], None if c.logprobs is None else []
        return c.text, c.token_ids, c.logprobs

    def _echo_logprobs(self, job: Job, prompt_index: int, out: RequestOutput) -> tuple[dict | None, int]:
        """Logprobs of the echoed prompt (the first token has none), and the text offset after it."""
        if job.params.logprobs is None or out.prompt_logprobs is None:
            return None, 0
        lp = self._logprobs(job, out.prompt_logprobs, out.prompt_token_ids, 0)
        return lp, _next_offset(lp, 0)

    def _choice(self, job: Job, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> dict:
        index = prompt_index * job.n + c.index
        text, token_ids, positions = self._generated(job, c)
        if job.kind == "chat":
            reply = job.chat_rules.final(text)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.reasoning is not None:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
            return {
                "index": index,
                "message": message,
                "logprobs": None if positions is None else self._logprobs(job, positions, token_ids, 0),
                "finish_reason": "tool_calls" if reply.tool_calls else c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        logprobs, offset = None, 0
        if job.echo:
            text = job.prompt_texts[prompt_index] + text
            logprobs, offset = self._echo_logprobs(job, prompt_index, out)
        if positions is not None:
            generated = self._logprobs(job, positions, token_ids, offset)
            logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in logprobs}
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": _finish(job, c)[0],
            "stop_reason": _finish(job, c)[1],
        }
        if job.return_prompt_logprobs:
            choice["prompt_logprobs"] = _prompt_logprobs_field(out)
        return choice

    def _logprobs(
        self, job: Job, positions: list[PositionLogprobs | None], token_ids: list[int], text_offset: int
    ) -> dict:
        """OpenAI logprobs: `content` entries for chat, the legacy arrays for completions, where a position
        without logprobs (the prompt's first token) has null ones."""

        def text(token_id: int, entry: PositionLogprobs | None) -> str:
            decoded = entry[token_id].decoded_token if entry is not None else self._decode_token(token_id)
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
            "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(token_ids, positions)],
            "top_logprobs": [
                None if e is None else {text(t, e): lp.logprob for t, lp in e.items()}
                for t, e in zip(token_ids, positions)
            ],
            "text_offset": offsets,
        }

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.llm.tokenizer is None else self.llm.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class _StreamState:
    """What a streamed choice has sent so far."""

    content: str = ""  # the text (completions) or content (chat)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # each with the arguments text sent so far
    positions_sent: int = 0  # logprobs positions
    offset: int = 0  # text_offset of the next token


def _tool_call_deltas(calls: list[PartialCall], sent: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed tool-call pieces: a call's id, name and arguments so far when it first appears, then
    what its arguments grew by (the client concatenates the pieces of each index)."""
    deltas: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        if index == len(sent):
            sent.append(ToolCall(call.name, call.arguments))
            deltas.append({"index": index, **sent[index].to_openai()})
        elif call.arguments.startswith(sent[index].arguments):
            grown = call.arguments[len(sent[index].arguments) :]
            if grown:
                sent[index].arguments = call.arguments
                deltas.append({"index": index, "function": {"arguments": grown}})
    return deltas


def _finish(job: Job, c: CompletionOutput) -> tuple[str | None, int | str | None]:
    """finish_reason and stop_reason: the prompt alone always ends by length (it returns no token to stop on)."""
    if job.prompt_only:
        return ("length" if c.finished else None), None
    return c.finish_reason, c.stop_reason


def _next_offset(logprobs: dict, start: int) -> int:
    """The text offset after the tokens of a legacy logprobs block."""
    return start + sum(len(t) for t in logprobs.get("tokens", []))


def _prompt_logprobs_field(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, null (the first) or {token id: logprob, rank, decoded}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def _usage(job: Job, outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if job.prompt_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return _usage_counts(prompt, completion)


def _usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
