"""Chat templates render as transformers renders them: the same Jinja environment (the
`{% generation %}` tag, loopcontrols, tojson's options, namespace, raise_exception)."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from prefixkv.model.chat_template import compile_chat_template
from prefixkv.model.tokenizer import Tokenizer, _bytes_to_unicode

# llava-hf/llava-1.5-7b-hf's template as published: assistant text wrapped in {% generation %}
LLAVA_HF = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{# Render all images first #}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != "
    "'assistant' %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', "
    "'equalto', 'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# whitespace control, tojson with options, namespace, break, dict(), strftime_now
FEATURES = """{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<{{ m['role'] }}>{{ m['content'] }}</s>
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2, sort_keys=true) }}{% endif %}
{{ dict(a=1) | tojson }} {{ ns.n }} <&> {{ "<b>" | tojson }} {{ strftime_now('%Y') | length }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

RAISES = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"


def _backend() -> Backend:
    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Backend(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<image>"])
    return tok


def _pair(template: str):
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer(_backend(), bos_token_id=256, eos_token_ids=[257], chat_template=template)
    hf = PreTrainedTokenizerFast(tokenizer_object=_backend(), bos_token="<s>", eos_token="</s>", chat_template=template)
    return ours, hf


LLAVA_CHAT = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A cat & a <dog>."}]},
    {"role": "user", "content": [{"type": "text", "text": "Sure?"}, {"type": "image"}]},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_generation_tag_renders_as_transformers(add_generation_prompt: bool) -> None:
    ours, hf = _pair(LLAVA_HF)
    want = hf.apply_chat_template(LLAVA_CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = ours.apply_chat_template(LLAVA_CHAT, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert "ASSISTANT: A cat & a <dog>. USER: <image>\nSure? " in got


def test_environment_features_render_as_transformers() -> None:
    ours, hf = _pair(FEATURES)
    chat = [{"role": r, "content": f'héllo {i} "q" <tag>'} for i, r in enumerate(["system", "user", "assistant"] * 2)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": "ü", "a": [1, 2]}}}]
    want = hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(chat, tools=tools, add_generation_prompt=True)
    assert got == want
    assert '"ü"' in got and "<&>" in got and " 3 " in got  # no HTML escaping; the loop broke after 3


def test_raise_exception_is_a_value_error_and_a_template_error() -> None:
    ours, hf = _pair(RAISES)
    with pytest.raises(jinja2.exceptions.TemplateError, match="first message must be from the user"):
        hf.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)
    for kind in (ValueError, jinja2.exceptions.TemplateError):
        with pytest.raises(kind, match="first message must be from the user"):
            ours.apply_chat_template([{"role": "system", "content": "x"}])


def test_sandbox_refuses_what_transformers_refuses() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{% set ns = namespace(_x=1) %}").render()
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: templates cannot edit the messages
        compile_chat_template("{{ messages.append(1) }}").render(messages=[])


def test_unknown_tag_still_fails_to_compile() -> None:
    with pytest.raises(jinja2.exceptions.TemplateSyntaxError, match="unknown tag 'nosuchtag'"):
        compile_chat_template("{% nosuchtag %}")
