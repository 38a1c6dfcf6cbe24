"""The model's sampling defaults (generation_config.json), as vLLM applies them: offline, `generate` without
sampling params uses them; on the server (through the `openai` client) a request's unset fields take them and the
file's max_new_tokens caps max_tokens; `generation_config="vllm"` ignores the file; a bad one is an error naming it."""

from __future__ import annotations

import json

import openai
import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.generation_config import sampling_defaults
from pagellm.errors import InvalidParameter
from tests.server.conftest import MODEL, start_server

PROMPTS = [[5, 17, 99, 3], [200, 7]]
CHAT = [{"role": "user", "content": "Tell me a story about a cat."}]


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_offline_generate_without_params_uses_the_model_defaults(recommending_model_dir):
    llm = LLM(str(recommending_model_dir), device="cpu", dtype="float32", quiet=True)
    expected = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=4)
    assert llm.get_default_sampling_params() == expected
    assert tokens(llm.generate(PROMPTS, use_tqdm=False)) == tokens(llm.generate(PROMPTS, expected, use_tqdm=False))
    ignored = LLM(str(recommending_model_dir), device="cpu", dtype="float32", quiet=True, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()


def test_a_directory_of_its_own_and_bad_files_are_errors_naming_the_option(recommending_model_dir, tmp_path):
    assert sampling_defaults(tmp_path, "auto") == {}  # no file: SamplingParams' own defaults
    assert sampling_defaults(tmp_path, str(recommending_model_dir)) == {
        "temperature": 0.0,
        "repetition_penalty": 1.3,
        "max_tokens": 4,
    }
    with pytest.raises(InvalidParameter, match="no generation_config.json there") as missing:
        LLM(str(recommending_model_dir), device="cpu", quiet=True, generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(InvalidParameter, match="top_p") as bad:
        sampling_defaults(tmp_path, "auto")
    (tmp_path / "generation_config.json").write_text("{temperature: 0.5")
    with pytest.raises(InvalidParameter, match="generation_config.json") as not_json:
        sampling_defaults(tmp_path, "auto")
    assert missing.value.param == bad.value.param == not_json.value.param == "generation_config"


@pytest.fixture(scope="module")
def recommending_server(recommending_model_dir):
    llm = AsyncLLM(EngineConfig(model=str(recommending_model_dir), device="cpu", dtype="float32", quiet=True))
    srv, url = start_server(llm)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    srv.should_exit = True
    llm.shutdown()


def chat_tokens(client: openai.OpenAI, extra: dict | None = None, **fields) -> tuple[str, int]:
    """The reply and its token count, run past EOS (so that the count is the max_tokens in force)."""
    body = {"ignore_eos": True, **(extra or {})}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, extra_body=body, **fields)
    return out.choices[0].message.content, out.usage.completion_tokens


def test_server_requests_take_the_model_defaults_for_what_they_leave_unset(recommending_server):
    client = recommending_server
    greedy = chat_tokens(client, {"repetition_penalty": 1.3}, temperature=0.0, max_tokens=4)
    assert chat_tokens(client) == greedy  # every sampling field unset: the file's
    assert chat_tokens(client, max_tokens=50)[1] == 4  # max_new_tokens caps what a request asks for
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4  # the completions API's own default of 16, capped
    # A request's own value wins: sampled at temperature 1 the 4 tokens differ from greedy's for some seed.
    sampled = {chat_tokens(client, temperature=1.0, seed=seed)[0] for seed in range(4)}
    assert sampled - {greedy[0]}
