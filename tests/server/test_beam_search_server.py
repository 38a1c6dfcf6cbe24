"""vLLM's `use_beam_search` through the `openai` client: the choices are the hypotheses `LLM.beam_search` finds for
the same prompt (tested against plain torch in tests/test_beam_search.py), best first; what it cannot go with is a
400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from pagellm import LLM, BeamSearchParams
from tests.server.conftest import MODEL


@pytest.fixture(scope="module")
def client(tiny_server):
    return OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), device="cpu", dtype="float32", quiet=True)


def test_completion_choices_are_the_best_hypotheses(client, offline):
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    response = client.completions.create(model=MODEL, prompt="The sea was", n=3, max_tokens=6, extra_body=extra)
    expected = offline.beam_search("The sea was", BeamSearchParams(3, 6, length_penalty=0.5))[0].sequences
    assert [c.text for c in response.choices] == [s.text for s in expected]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.finish_reason for c in response.choices] == [s.finish_reason for s in expected]
    prompt_len = len(offline.engine.input_processor.tokenize("The sea was"))
    assert response.usage.completion_tokens == sum(len(s.tokens) - prompt_len for s in expected)


def test_each_prompt_of_a_completion_gets_its_own_search(client, offline):
    prompts = ["Once upon", "The cat"]
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, extra_body={"use_beam_search": True}
    )
    expected = offline.beam_search(prompts, BeamSearchParams(2, 4))
    assert [c.text for c in response.choices] == [s.text for out in expected for s in out.sequences]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]


def test_chat_choices_are_the_best_hypotheses(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=5, extra_body={"use_beam_search": True}
    )
    prompt = offline.chat_prompt_ids(messages)
    expected = offline.beam_search([prompt], BeamSearchParams(2, 5))[0].sequences
    assert [c.message.content for c in response.choices] == [s.text for s in expected]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"n": 11}, "n"),
        ({"stream": True}, "use_beam_search"),
        ({"logprobs": 2}, "use_beam_search"),
        ({"echo": True}, "use_beam_search"),
        ({"guided_regex": "[a-z]+"}, "use_beam_search"),
    ],
)
def test_what_beam_search_cannot_go_with_is_refused(client, extra, field):
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"use_beam_search": True, **extra})
    assert caught.value.body["param"] == field, caught.value.body


def test_a_client_that_hangs_up_mid_search_stops_it(tiny_server):
    """A search of 250 rounds of 10 beams runs for seconds: once the client is gone the round in flight is aborted
    and no later one starts, so the engine is idle and every block free within a second."""
    body = {"model": MODEL, "prompt": "Tell a story", "n": 10, "max_tokens": 250, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        response = httpx.post(f"{tiny_server.url}/v1/completions", json=body | {"ignore_eos": True}, timeout=0.5)
        pytest.fail(f"the search was over in half a second: {response.status_code} {response.text[:200]}")
    tiny_server.wait_idle(timeout=1.0)
