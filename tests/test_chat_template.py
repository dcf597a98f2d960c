"""data/chat_template.py: a Hugging Face chat template rendered as transformers renders it, the default for a
model without one, and bad messages or templates as one ChatError."""

import re

import pytest
from test_tokenizer import BOS, LLAMA_CONFIG, make_tokenizer

from data import chat_template, tokenizer

# Llama 3's shape: BOS written by the template, a header per turn, <|eot_id|> after each;
# trim_blocks and lstrip_blocks remove the newline after a block tag and the indentation before one.
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
{{ '<|start|>' + message['role'] + '\n' + message['content'] + '<|eot_id|>' }}
{%- endfor %}
{% if add_generation_prompt %}{{ '<|start|>assistant\n' }}{% endif %}"""


def test_a_template_renders_like_transformers_and_encodes_with_one_bos(tmp_path):
    tok = tokenizer.hf_tokenizer(
        make_tokenizer(tmp_path / "tok", files={"tokenizer_config.json": {**LLAMA_CONFIG, "chat_template": TEMPLATE}})
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    text = chat_template.render(tok, messages)
    assert text == (
        "<|begin_of_text|><|start|>system\nBe brief.<|eot_id|><|start|>user\nHello, world!<|eot_id|>"
        "<|start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == BOS and ids.count(BOS) == 1  # the special token's text became its id, once
    assert not chat_template.render(tok, messages, add_generation_prompt=False).endswith("assistant\n")
    # transformers 5 keeps the template in a file of its own; it wins over tokenizer_config.json's
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert chat_template.render(tokenizer.hf_tokenizer(tmp_path / "tok"), messages) == "Be brief.!"


def test_the_default_template_and_bad_messages():
    tok = tokenizer.char_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ: \n")
    text = chat_template.render(tok, [{"role": "user", "content": "hi"}])
    assert text == "USER: hi\n\nASSISTANT:" and tok.decode(tok.encode(text)) == text
    for bad, words in (
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "messages[0] must be"),
        ([{"role": "user", "content": 3}], "messages[0].content must be"),
    ):
        with pytest.raises(chat_template.ChatError, match=re.escape(words)):
            chat_template.render(tok, bad)


def test_a_template_that_raises_is_a_chat_error(tmp_path):
    tok = tokenizer.hf_tokenizer(
        make_tokenizer(
            tmp_path / "tok",
            files={"tokenizer_config.json": {**LLAMA_CONFIG, "chat_template": "{{ raise_exception('system first') }}"}},
        )
    )
    with pytest.raises(chat_template.ChatError, match="system first"):
        chat_template.render(tok, [{"role": "user", "content": "hi"}])
