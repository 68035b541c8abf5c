"""A tiny checkpoint with Gemma 4's reply markers as special tokens (`<|channel>`, `<channel|>`,
`<|tool_call>`, `<tool_call|>`, the string delimiter `<|"|>`, its turns), a bigram model built as
scripted_thinker.py's: greedy, after a prompt that ends with "\\n" (Gemma 4's `<|turn>model\\n`) it
thinks in a channel, then calls a tool,

    <|channel>thought\\nhm<channel|><|tool_call>call:get_weather{days:42}<tool_call|><turn|>

and `<turn|>` ends the reply. What Gemma 4's reasoning and tool parsers read, end to end."""

from __future__ import annotations

from pathlib import Path

from .scripted_thinker import write_scripted_model

# "thought\n" and "call:get_weather{days:" whole (added tokens): a bigram model writes no letter twice
MARKERS = ["thought\n", "call:get_weather{days:"]
SPECIALS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|turn>", "<turn|>"]
SPECIALS += ["<|tool_response>", "<tool_response|>", "<|think|>"]
SCRIPT = [("\n", "<|channel>"), ("<|channel>", "thought\n"), ("thought\n", "h"), ("h", "m"), ("m", "<channel|>")]
SCRIPT += [("<channel|>", "<|tool_call>"), ("<|tool_call>", "call:get_weather{days:"), ("call:get_weather{days:", "4")]
SCRIPT += [("4", "2"), ("2", "}"), ("}", "<tool_call|>"), ("<tool_call|>", "<turn|>")]

TEMPLATE = (  # Gemma 4's shape, short: tools declared in the system turn, earlier calls rendered
    "{% if tools %}<|turn>system\n{{ tools | tojson }}<turn|>\n{% endif %}"
    "{% for m in messages %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{}<tool_call|>{% endfor %}"
    "<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def write_scripted_gemma4(folder: Path) -> Path:
    return write_scripted_model(folder, MARKERS, SPECIALS, SCRIPT, TEMPLATE, ["<turn|>"])
