"""LLM: the offline front door (vLLM-style `generate` and `chat`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from pagellm.config import EngineConfig, engine_option_names
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from pagellm.engine.engine import make_engine
from pagellm.engine.input_processor import ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

# vLLM's forms: text, token ids, or their dicts (TextPrompt {"prompt": ...}, TokensPrompt {"prompt_token_ids": ...}).
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = {"prompt": str, "prompt_token_ids": list}
Messages = list[dict[str, Any]]


class LLM:
    """`LLM(model, **options)`: the options are EngineConfig's fields (vLLM's names and defaults), e.g.
    `LLM("Qwen/Qwen3-0.6B", max_model_len=4096, kv_cache_dtype="int8", async_scheduling=False)`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        unknown = sorted(set(options) - set(engine_option_names()))
        if unknown:
            raise InvalidParameter(
                unknown[0], f"{unknown[0]}: not an engine option; the options are {', '.join(engine_option_names())}"
            )
        self.engine = make_engine(EngineConfig(model=model, **options))
        self._request_numbers = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: the model's generation_config.json defaults
        (see the `generation_config` option), else SamplingParams()."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompt_list))
        # Only final outputs are returned, so the engine need not build one per token (as vLLM's LLM does).
        final_only = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list}
        # Every request validated (its text tokenized, once) before any is queued: a bad one fails the call and
        # leaves nothing behind.
        requests = [
            self.engine.input_processor.process(prompt, final_only[id(params)], f"llm-{next(self._request_numbers)}")
            for prompt, params in zip(prompt_list, params_list)
        ]
        return self._run(requests, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """The beam_width best hypotheses of each prompt, best first (see `engine/beam_search.py`)."""
        prompt_ids = [self.engine.input_processor.tokenize(prompt) for prompt in _as_prompt_list(prompts)]
        return beam_search(
            prompt_ids,
            params,
            lambda round_prompts, round_params: self.generate(round_prompts, round_params, use_tqdm),
            self.engine.input_processor.eos_token_ids,
            self.engine.max_model_len,
            None if self.tokenizer is None else self.tokenizer.decode,
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with the tools it may call, in OpenAI's format),
        then generate. Tool calls are left in the text: parsing them is the server's job. continue_final_message
        (with add_generation_prompt=False) has the model go on with the last message, e.g. a started reply."""
        if not messages:
            raise InvalidParameter("messages", "messages: must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.chat_prompt_ids(conv, add_generation_prompt, chat_template_kwargs, tools, continue_final_message)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(
        self,
        conversation: Messages,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        _check_messages(conversation)
        if self.tokenizer is None:
            raise InvalidParameter("messages", "messages: this model has no tokenizer, so no chat template")
        return self.tokenizer.chat_prompt_ids(
            conversation, add_generation_prompt, chat_template_kwargs, tools, continue_final_message
        )

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks' processes now (they stop with this process otherwise)."""
        self.engine.shutdown()

    def _run(self, requests: list[ProcessedRequest], use_tqdm: bool) -> list[RequestOutput]:
        order = {request.request_id: i for i, request in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm or self.engine.config.quiet)
        try:
            for request in requests:
                self.engine.enqueue(request)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update()
        finally:
            bar.close()
            for request, out in zip(requests, results):
                if out is None:  # interrupted: free what is left (ids not queued yet are ignored)
                    self.engine.abort(request.request_id)
        return results


PROMPT_FORMS = "a string, a list of token ids, or a dict of one of them"


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, Iterable):
        raise InvalidParameter("prompts", f"prompts: must be {PROMPT_FORMS}, or a list of prompts; got {prompts!r:.60}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise InvalidParameter("prompts", "prompts: must not be empty")
    prompts = [_unwrap_prompt_dict(p) if isinstance(p, dict) else p for p in prompts]
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise InvalidParameter("prompts", f"prompts: each prompt must be {PROMPT_FORMS}; got {p!r:.60}")
    return prompts


def _unwrap_prompt_dict(prompt: dict[str, Any]) -> str | list[int]:
    """{"prompt": text} or {"prompt_token_ids": ids}: exactly one of the two keys, nothing else."""
    keys = sorted(prompt)
    if len(keys) != 1 or keys[0] not in PROMPT_KEYS:
        raise InvalidParameter(
            "prompts", f"prompts: a prompt dict takes exactly one of {sorted(PROMPT_KEYS)}; got keys {keys}"
        )
    value = prompt[keys[0]]
    if not isinstance(value, PROMPT_KEYS[keys[0]]):
        raise InvalidParameter("prompts", f"prompts: {keys[0]} must be a {PROMPT_KEYS[keys[0]].__name__}")
    return value


def _as_params_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, dict) or not isinstance(params, Iterable):
        kind = type(params).__name__
        raise InvalidParameter(
            "sampling_params", f"sampling_params: must be a SamplingParams or a list of them; got {kind}"
        )
    params = list(params)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidParameter("sampling_params", "sampling_params: each entry must be a SamplingParams")
    if len(params) != n:
        raise InvalidParameter(
            "sampling_params", f"sampling_params: got {len(params)} for {n} prompts; pass one, or one per prompt"
        )
    return params


def _check_messages(conversation: Messages) -> None:
    if not conversation:
        raise InvalidParameter("messages", "messages: must not be empty")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidParameter("messages", f"messages[{i}]: must be a dict with 'role' and 'content'")
