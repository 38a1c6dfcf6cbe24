"""Structured outputs in the engine (offline API): constrained samples follow their grammar, unconstrained rows
batched with them are untouched, bad grammars are refused before anything is queued; tool-call and reasoning
parsers on recorded outputs of each model family, streamed and not."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.engine import structured_outputs
from pagellm.engine.structured_outputs import check_json_schema
from pagellm.errors import InvalidParameter
from pagellm.outputs import CompletionOutput
from pagellm.server.chat_output import ChatOutputRules
from pagellm.server.serving import Job, OpenAIServing, _StreamState
from pagellm.server.tool_parsers import TOOL_PARSERS, Qwen3ReasoningParser


@pytest.fixture(scope="module")
def tiny_chat_llm(tiny_chat_model_dir):
    return LLM(str(tiny_chat_model_dir), device="cpu", dtype="float32", quiet=True)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(tiny_chat_llm):
    prompts = [[10, 20, 30], [40, 50], [60, 70, 80, 90]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = tiny_chat_llm.generate(prompts, greedy, use_tqdm=False)
    regex = StructuredOutputsParams(regex="[a-z]{3,40}")
    constrained = SamplingParams(temperature=1.0, max_tokens=24, seed=1, structured_outputs=regex)
    mixed = tiny_chat_llm.generate(
        prompts[:1] + [[5, 6]] + prompts[1:] + [[7, 8, 9]],
        [greedy, constrained, greedy, greedy, constrained],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in alone] == [mixed[i].outputs[0].token_ids for i in (0, 2, 3)]
    for i in (1, 4):  # a random model follows the grammar too (it is cut by max_tokens, not by the grammar)
        text = mixed[i].outputs[0].text
        assert re.fullmatch("[a-z]{3,40}", text) or (mixed[i].outputs[0].finish_reason == "length" and text.isalpha())


def test_a_grammar_completed_under_ignore_eos_leaves_the_rest_unconstrained(tiny_chat_llm):
    """A stop token that ignore_eos lets through completes the grammar, yet the sample goes on: it must run to
    max_tokens (no mask is asked of a finished grammar, which xgrammar refuses) beside an untouched neighbour."""
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True, structured_outputs=choice)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = tiny_chat_llm.generate([[40, 50]], greedy, use_tqdm=False)[0].outputs[0]
    constrained, neighbour = (
        o.outputs[0] for o in tiny_chat_llm.generate([[10, 20], [40, 50]], [params, greedy], use_tqdm=False)
    )
    eos = tiny_chat_llm.engine.model_config.eos_token_ids
    assert len(constrained.token_ids) == 8 and constrained.finish_reason == "length"
    answer_end = next(i for i, t in enumerate(constrained.token_ids) if t in eos)
    assert tiny_chat_llm.tokenizer.hf.decode(constrained.token_ids[:answer_end]) in ("yes", "no")
    assert neighbour.token_ids == alone.token_ids


def test_constrained_samples_beside_finishing_neighbours_sample_as_alone(tiny_chat_llm):
    """Seeded samples under different grammars, batched, draw what they draw alone: while neighbours finish sooner
    (their look-ahead rows are wasted) and after a grammar completed under ignore_eos (the sample goes on
    unconstrained beside constrained rows)."""
    letters = ["a-e", "f-j", None, "k-o"]
    patterns = [letter and f"[{letter}]+( [{letter}]+)*" for letter in letters]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=3 + 4 * i,
            ignore_eos=pattern is None,
            structured_outputs={"regex": pattern} if pattern else {"choice": ["yes", "no"]},
        )
        for i, pattern in enumerate(patterns)
    ]
    prompts = [[10 + i, 20, 30] for i in range(len(params))]
    batched = [o.outputs[0] for o in tiny_chat_llm.generate(prompts, params, use_tqdm=False)]
    alone = [tiny_chat_llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert len({len(o.token_ids) for o in batched}) > 1  # the neighbours do finish at different steps
    for out, pattern, letter in zip(batched, patterns, letters):
        if pattern is not None:  # cut by max_tokens, an output is a start of one
            assert re.fullmatch(pattern if out.finish_reason == "stop" else f"[{letter} ]*", out.text), out.text


def test_an_abort_while_two_constrained_steps_are_in_flight(tiny_chat_llm):
    """Once a constrained look-ahead step samples, its successor is launched too: between two step() calls two
    steps are in flight. Aborting a request then and reusing its id leaves the neighbour's samples what they are
    alone, gives the new request its own output, and frees every block."""
    engine = tiny_chat_llm.engine
    regex = {"regex": "[a-z]+( [a-z]+)*"}
    neighbour = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, structured_outputs=regex)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [
        tiny_chat_llm.generate([prompt], [params], use_tqdm=False)[0].outputs[0].token_ids
        for prompt, params in (([40, 50], neighbour), ([4, 5, 6], greedy))
    ]
    engine.add_request([10, 20], SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=regex), "x")
    engine.add_request([40, 50], neighbour, "y")
    outs = engine.step() + engine.step()
    assert engine._launched_next is not None  # the case under test: two steps in flight
    engine.abort("x")
    engine.add_request([4, 5, 6], greedy, "x")
    while engine.has_unfinished():
        outs += engine.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert finals["y"].outputs[0].token_ids == alone[0]
    assert finals["x"].prompt_token_ids == [4, 5, 6] and finals["x"].outputs[0].token_ids == alone[1]
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_threaded_bitmask_fill_equals_one_row_at_a_time(tiny_chat_llm, monkeypatch):
    """From BATCH_FILL_ROWS constrained rows on, xgrammar's batch fill runs on threads (one thread on a 2-core
    machine: forced to 2 here); the samples are those of the one-by-one fill."""
    rows = structured_outputs.BATCH_FILL_ROWS
    params = [
        SamplingParams(temperature=1.0, max_tokens=16, seed=i, structured_outputs={"regex": "[a-z]{2,8}( [0-9]+)?"})
        for i in range(rows)
    ]
    prompts = [[10 + i, 20, 30] for i in range(rows)]
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(structured_outputs, "FILL_THREADS", threads)
        runs.append([o.outputs[0].text for o in tiny_chat_llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert all(re.fullmatch("[a-z]{2,8}( [0-9]+)?", text) for text in runs[1]), runs[1]


def test_offline_structured_outputs_on_smollm2(smollm2_llm):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "legs": {"type": "integer", "maximum": 8}},
        "required": ["name", "legs"],
    }
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=80, structured_outputs={"json": schema})
    out = smollm2_llm.chat([{"role": "user", "content": "An animal as JSON."}], params, use_tqdm=False)[0]
    for sample in out.outputs:
        value = json.loads(sample.text)
        assert set(value) == {"name", "legs"} and isinstance(value["legs"], int) and value["legs"] <= 8
    choice = SamplingParams(
        temperature=1.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["A", "B"])
    )
    assert smollm2_llm.generate("Answer:", choice, use_tqdm=False)[0].outputs[0].text in ("A", "B")
    # The empty schema: any JSON value.
    anything = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=60, structured_outputs={"json": {}})
    request = [{"role": "user", "content": "A person as a JSON object."}]
    samples = smollm2_llm.chat(request, anything, use_tqdm=False)[0].outputs
    done = [sample.text for sample in samples if sample.finish_reason == "stop"]
    assert done, [sample.text for sample in samples]
    for text in done:
        json.loads(text)  # raises unless the whole output is one JSON value


def test_bad_grammars_queue_nothing(smollm2_llm):
    good = SamplingParams(max_tokens=2)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidParameter, match="structured_outputs.regex"):
        smollm2_llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished()
    with pytest.raises(InvalidParameter, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidParameter, match=r"structured_outputs.choice=\[\] is invalid: must be a non-empty list"):
        StructuredOutputsParams(choice=[])  # given, though empty: not "set none"
    with pytest.raises(InvalidParameter, match="structured_outputs.grammar='' is invalid"):
        StructuredOutputsParams(grammar="")
    with pytest.raises(InvalidParameter, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(InvalidParameter, match="structured_outputs.json: a string schema must be JSON"):
        StructuredOutputsParams(json="{'type': 'object'}")
    lone_surrogate = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a\udcff"))
    with pytest.raises(InvalidParameter, match="structured_outputs.regex: not valid Unicode"):
        smollm2_llm.generate("x", lone_surrogate, use_tqdm=False)
    with pytest.raises(InvalidParameter, match="prompt: not valid Unicode"):
        smollm2_llm.generate("x\ud800", good, use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished()
    # Found by schemathesis: xgrammar's error about this grammar is cut inside a UTF-8 character.
    odd = SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar="\u00d9\u009c\u0086+\U00108e16\u00b8\u00e1")
    )
    with pytest.raises(InvalidParameter, match="structured_outputs.grammar"):
        smollm2_llm.generate("x", odd, use_tqdm=False)


def test_allowed_tokens_that_no_output_of_the_grammar_opens_with_are_refused(smollm2_llm):
    """Every logit of the first step would be -inf: before, token 0 was drawn, outside both constraints."""
    (b,) = smollm2_llm.tokenizer.encode("b", add_special_tokens=False)
    (a,) = smollm2_llm.tokenizer.encode("a", add_special_tokens=False)
    only_a = StructuredOutputsParams(regex="a+")
    with pytest.raises(InvalidParameter, match="allowed_token_ids: the structured output can start with none"):
        smollm2_llm.generate("x", SamplingParams(allowed_token_ids=[b], structured_outputs=only_a), use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished()
    params = SamplingParams(max_tokens=3, allowed_token_ids=[a, b], structured_outputs=only_a)
    assert smollm2_llm.generate("x", params, use_tqdm=False)[0].outputs[0].token_ids == [a, a, a]


def test_schema_keyword_check_reads_property_names_as_names():
    named_like_keywords = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    check_json_schema(named_like_keywords, "f")  # no error
    with pytest.raises(InvalidParameter, match=r"#/properties/a/not is not supported"):
        check_json_schema({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "f")
    with pytest.raises(InvalidParameter, match="not a valid JSON schema"):
        check_json_schema({"type": "objekt"}, "f")


def test_chat_renders_tools_like_hf(tiny_chat_model_dir, tmp_path):
    """LLM.chat(tools=...) gives the tokens HF's own apply_chat_template(tools=...) gives."""
    import shutil

    model_dir = tmp_path / "with-tools-template"
    shutil.copytree(tiny_chat_model_dir, model_dir)
    template = (
        "{% for tool in tools or [] %}<tool>{{ tool.function.name }}: {{ tool.function.description }}</tool>\n"
        "{% endfor %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (model_dir / "chat_template.jinja").write_text(template)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": {}}}]
    messages = [{"role": "user", "content": "Weather?"}]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", quiet=True)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tool>get_weather: Forecast</tool>" in expected
    ours = llm.chat(messages, SamplingParams(max_tokens=1), tools=tools, use_tqdm=False)[0].prompt_token_ids
    assert ours == hf.encode(expected, add_special_tokens=False)


RECORDED = [  # (parser, reply as the model wrote it, content, [(name, arguments)])
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    ("hermes", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", {"a": 1})]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}',
        None,
        [("get_weather", {"city": "Oslo", "days": 3})],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        None,
        [("a", {}), ("b", {"x": 1})],
    ),
    ("llama3_json", "Oslo is rainy.", "Oslo is rainy.", []),
    (
        "pythonic",
        '[get_weather(city="San Francisco", days=2), get_time(zone="UTC", exact=True)]',
        None,
        [("get_weather", {"city": "San Francisco", "days": 2}), ("get_time", {"zone": "UTC", "exact": True})],
    ),
    ("pythonic", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
]


@pytest.mark.parametrize("parser,reply,content,calls", RECORDED)
def test_tool_parsers_on_recorded_replies(parser, reply, content, calls):
    got_content, got_calls = TOOL_PARSERS[parser]().parse(reply)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


def stream_through_serving(rules: ChatOutputRules, reply: str, piece: int = 3) -> tuple[str, str, list, str, int]:
    """The chunks the server sends for `reply` arriving `piece` characters at a time, merged as the openai client
    does (tool-call pieces by index): (reasoning, content, [(name, arguments)], finish_reason, how many chunks
    before the last carried tool-call pieces)."""
    serving = OpenAIServing.__new__(OpenAIServing)
    job = Job("chat", "m", [], SamplingParams(), [""], chat_rules=rules)
    state, reasoning, content, calls, finish, early = _StreamState(), "", "", {}, None, 0
    for end in list(range(piece, len(reply), piece)) + [len(reply)]:
        done = end == len(reply)
        out = CompletionOutput(0, reply[:end], [], finish_reason="stop" if done else None)
        choice = serving._chat_stream_choice(job, 0, out, state, None)
        if choice is None:
            continue
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for piece_of_call in delta.get("tool_calls", []):
            first = piece_of_call["index"] not in calls
            assert ("id" in piece_of_call) == first == ("name" in piece_of_call["function"])  # a call's first piece
            call = calls.setdefault(piece_of_call["index"], {"name": "", "arguments": ""})
            call["name"] += piece_of_call["function"].get("name", "")
            call["arguments"] += piece_of_call["function"]["arguments"]
        early += bool(delta.get("tool_calls")) and not done
        finish = choice["finish_reason"] or finish
    merged = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    return reasoning, content, merged, finish, early


@pytest.mark.parametrize("parser,reply,content,calls", RECORDED)
@pytest.mark.parametrize("piece", [1, 4])
def test_streamed_tool_calls_reassemble_to_the_whole(parser, reply, content, calls, piece):
    rules = ChatOutputRules("auto", TOOL_PARSERS[parser]())
    _, streamed, streamed_calls, finish, early = stream_through_serving(rules, reply, piece)
    assert streamed_calls == calls
    assert streamed.strip() == (content or "")
    assert finish == ("tool_calls" if calls else "stop")
    if calls:  # no part of a call leaked into the content on the way
        assert "get_" not in streamed and "{" not in streamed
    # The calls stream as they are written (the pythonic format's whole calls, once closed: all but the last
    # arrive before the end); arguments written as a JSON string come with the last chunk.
    string_arguments = '"arguments": "' in reply
    assert early > 0 if len(calls) > 1 or (calls and parser != "pythonic" and not string_arguments) else early == 0


@pytest.mark.parametrize(
    "rules,reply,calls",
    [
        (
            ChatOutputRules("required"),
            '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}]',
            [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "UTC"})],
        ),
        (ChatOutputRules("named", function="get_time"), '{"zone": "CET"}', [("get_time", {"zone": "CET"})]),
    ],
)
@pytest.mark.parametrize("piece", [1, 6])
def test_forced_tool_calls_stream_as_written(rules, reply, calls, piece):
    _, content, streamed_calls, finish, early = stream_through_serving(rules, reply, piece)
    assert (content, streamed_calls, finish) == ("", calls, "tool_calls")
    assert early > 0


@pytest.mark.parametrize("piece", [1, 5])
def test_reasoning_split_streamed_and_not(piece):
    parser = Qwen3ReasoningParser()
    reply = "<think>\nFirst, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4."
    assert parser.split(reply) == ("First, 2 + 2.\nThat is 4.", "The answer is 4.")
    assert parser.split("<think>still going") == ("still going", "")
    assert parser.split("No thinking here.") == (None, "No thinking here.")
    reasoning, content, _, _, _ = stream_through_serving(ChatOutputRules(reasoning_parser=parser), reply, piece)
    assert reasoning.strip() == "First, 2 + 2.\nThat is 4." and content == "The answer is 4."
