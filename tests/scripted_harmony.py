"""A tiny checkpoint that answers in OpenAI's harmony format (gpt-oss's), greedy, by script
(tests/scripted_thinker.py's bigram construction): without tools in the prompt it thinks "hm" on
the analysis channel and answers "OK" on the final one; with tools it thinks "Need weather." and
calls get_weather with {"city":"Paris"}. Harmony's markers are special tokens of its vocabulary,
as in gpt-oss's. A bigram model writes each token after one token only, so headers that would
repeat a marker are single added tokens of their whole text (the text a reply reads is the same),
and the final channel's header, in harmony's own tokens, names the role "Assistant"."""

from __future__ import annotations

from pathlib import Path

from prefixkv import harmony

from .scripted_thinker import write_scripted_model

ANALYSIS = "<|channel|>analysis<|message|>"
THOUGHT = "<|channel|>analysis<|message|>Need weather.<|end|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ARGUMENTS = '{"city":"Paris"}'
MARKERS = ["assistant", "helper", "Assistant", "final", ANALYSIS, THOUGHT, CALL_HEADER, ARGUMENTS]
# the final channel's header in harmony's own tokens (what a grammar's gate waits for)
SCRIPT = [("assistant", ANALYSIS), (ANALYSIS, "h"), ("h", "m"), ("m", "<|end|>"), ("<|end|>", "<|start|>")]
SCRIPT += [("<|start|>", "Assistant"), ("Assistant", "<|channel|>"), ("<|channel|>", "final"), ("final", "<|message|>")]
SCRIPT += [("<|message|>", "O"), ("O", "K"), ("K", "<|return|>")]
SCRIPT += [("helper", THOUGHT), (THOUGHT, CALL_HEADER), (CALL_HEADER, ARGUMENTS), (ARGUMENTS, "<|call|>")]
# <|call|> is no EOS of the checkpoint (as gpt-oss's generation_config.json): the server stops there
SCRIPT += [("<|call|>", "Z")]

TEMPLATE = (  # harmony's turns, short; the generation prompt ends in "helper" where tools are given
    "{% for m in messages %}<|start|>{{ m.role }}"
    "{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>{{ m.role }}{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>{% if tools %}helper{% else %}assistant{% endif %}{% endif %}"
)


def write_scripted_harmony(folder: Path) -> Path:
    return write_scripted_model(folder, MARKERS, list(harmony.MARKERS), SCRIPT, TEMPLATE, [harmony.RETURN])
