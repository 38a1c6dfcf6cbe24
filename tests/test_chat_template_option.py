"""`chat_template` (vLLM's --chat-template): a template of the user's replaces the model's, given as a file or as
the text itself; the prompt is what transformers' apply_chat_template writes with the same template."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from pagellm import LLM, SamplingParams
from pagellm.errors import InvalidParameter

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def templateless_dir(tiny_chat_model_dir, tmp_path_factory):
    """The tiny chat model without a chat template, as base models ship."""
    path = tmp_path_factory.mktemp("templateless") / "model"
    shutil.copytree(tiny_chat_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_template_of_ones_own_as_a_file_or_as_text(templateless_dir, tmp_path):
    hf = AutoTokenizer.from_pretrained(templateless_dir)
    text = hf.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    expected = hf.encode(text, add_special_tokens=False)
    with pytest.raises(InvalidParameter, match="no chat template"):
        LLM(str(templateless_dir), device="cpu", quiet=True).chat(MESSAGES)
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    for template in (str(file), TEMPLATE):
        llm = LLM(str(templateless_dir), device="cpu", quiet=True, chat_template=template)
        assert llm.chat_prompt_ids(MESSAGES) == expected
        assert llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_token_ids == expected


def test_a_template_path_that_cannot_be_read_is_an_error_naming_the_option(templateless_dir, tmp_path):
    with pytest.raises(InvalidParameter, match="could not be read") as missing:
        LLM(str(templateless_dir), device="cpu", quiet=True, chat_template=str(tmp_path / "nowhere.jinja"))
    assert missing.value.param == "chat_template"
