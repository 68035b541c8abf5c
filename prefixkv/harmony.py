"""OpenAI's harmony format (gpt-oss's replies): an assistant reply is a run of messages, each a
header and a body,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

the first one's `<|start|>assistant` in the prompt already. A header names the message's channel
(`analysis`: reasoning; `final`: the answer; `commentary`: a preamble, or with a recipient
` to=functions.NAME` a tool call), optionally its content type (`<|constrain|>json`, or a bare
`json`); a body ends at `<|end|>`, `<|call|>` or `<|return|>` (the last two also end the reply),
or where the output stops. These are read from the reply's text with its special tokens kept, as
openai_harmony's StreamableParser reads them from its tokens (tests/test_harmony.py compares the
two on the same replies), and sorted as vLLM's harmony parser sorts them: reasoning, content,
tool calls, and builtin tools' messages (browser, python, container), which no client here runs,
left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
# recipients that name gpt-oss's builtin tools, not a client's function
BUILTIN_TOOLS = frozenset({"python", "browser", "container"})

_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")


@dataclass
class HarmonyMessage:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str
    done: bool  # its body ended (else the output stopped inside it)

    @property
    def kind(self) -> str:
        """ "tool", "reasoning", "content" or "ignored" (vLLM's sorting)."""
        if self.recipient is not None and is_function_recipient(self.recipient):
            return "tool"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "ignored"

    @property
    def function(self) -> str:
        assert self.recipient is not None
        return self.recipient.removeprefix("functions.")

    def arguments(self) -> str:
        """A tool call's arguments: JSON re-serialised (json.dumps' spacing, as vLLM returns it),
        or the text as it is where it is not JSON or the content type says another format."""
        if self.content_type is not None and "json" not in self.content_type:
            return self.text
        try:
            return json.dumps(json.loads(self.text))
        except ValueError:
            return self.text


def is_function_recipient(recipient: str) -> bool:
    """Whether a message to `recipient` calls a client's function: `functions.NAME`, or a bare
    name that is not a builtin tool (vLLM's rule for chat)."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in BUILTIN_TOOLS


def parse_header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header's text (after its role)."""
    recipient = channel = None
    rest = header
    m = _RECIPIENT.search(rest)
    if m:
        recipient = m.group(1)
        rest = rest[: m.start()] + " " + rest[m.end() :]
    m = _CHANNEL.search(rest)
    if m:
        channel = m.group(1) or None
        rest = rest[: m.start()] + " " + rest[m.end() :]
    content_type = rest.strip() or None
    return channel, recipient, content_type


class HarmonyReply:
    """A reply's messages as its text grows: `update(text)` with the whole text so far parses
    only what follows the messages already ended (a long reply streams in linear time);
    `messages` holds the ended ones and the one in progress. `unparsed` is the text of a header
    not yet ended by `<|message|>`."""

    def __init__(self) -> None:
        self.messages: list[HarmonyMessage] = []
        self._done = 0  # characters of the text in ended messages
        self._ended: list[HarmonyMessage] = []
        self.unparsed = ""

    def update(self, text: str) -> list[HarmonyMessage]:
        at = self._done
        current: HarmonyMessage | None = None
        self.unparsed = ""
        while at < len(text):
            body = text.find(MESSAGE, at)
            if body < 0:
                self.unparsed = text[at:]
                break
            header = text[at:body]
            role = "assistant"
            if header.startswith(START):
                header = header[len(START) :]
                m = re.match(r"[^\s<]*", header)
                role = m.group(0) if m and m.group(0) else "assistant"
                header = header[len(role) :]
            channel, recipient, content_type = parse_header(header)
            start = body + len(MESSAGE)
            ends = [(i, e) for e in BODY_ENDS if (i := text.find(e, start)) >= 0]
            if not ends:
                current = HarmonyMessage(role, channel, recipient, content_type, text[start:], False)
                break
            end, marker = min(ends)
            self._ended.append(HarmonyMessage(role, channel, recipient, content_type, text[start:end], True))
            at = self._done = end + len(marker)
        self.messages = self._ended + ([current] if current is not None else [])
        return self.messages


TOOL_CALL_START = START + "assistant to="


def tool_call_text(m: HarmonyMessage) -> str:
    """A tool call's message as harmony text (what `split_tool_calls` reads back): how the reply's
    split hands its calls, in place, to the `openai` tool parser."""
    content_type = f" {m.content_type}" if m.content_type else ""
    head = f"{TOOL_CALL_START}{m.recipient}{CHANNEL}{m.channel or 'commentary'}{content_type}{MESSAGE}"
    return head + m.text + (CALL if m.done else "")


def split_tool_calls(text: str) -> tuple[str, list[HarmonyMessage]]:
    """(`text` without its tool calls' harmony text, those calls' messages)."""
    rest: list[str] = []
    calls: list[HarmonyMessage] = []
    at = 0
    while (begin := text.find(TOOL_CALL_START, at)) >= 0:
        rest.append(text[at:begin])
        end = text.find(CALL, begin)
        at = len(text) if end < 0 else end + len(CALL)
        calls += HarmonyReply().update(text[begin:at])
    rest.append(text[at:])
    return "".join(rest), calls


def reasoning_token_count(
    token_ids: Sequence[int], decode: Callable[[list[int]], str], specials: frozenset[int], message_id: int
) -> int:
    """How many of a reply's tokens are reasoning, as vLLM counts them: the tokens of analysis
    bodies and of tool calls' bodies, the special tokens not counted. `decode` turns a header's
    tokens into its text; `specials` are the format's marker ids; `message_id` is `<|message|>`'s."""
    count, inside, counts = 0, False, False
    header: list[int] = []
    for token in token_ids:
        if inside:
            if token in specials:
                inside, header = False, []
                if token != message_id:
                    continue
            else:
                count += counts
                continue
        if token == message_id:
            channel, recipient, _ = parse_header(decode(header).split(START)[-1])
            counts = channel == "analysis" or (channel == "commentary" and recipient is not None)
            inside = True
            continue
        header.append(token)
    return count
