"""Reasoning parsers (vLLM's `--reasoning-parser`): where a thinking model's reasoning ends and
its answer begins.

A parser names the tokens around the reasoning (`<think>` ... `</think>`). One object decides for
both sides, so they agree by construction on where the reasoning ends:

- the engine starts a request's grammar (structured outputs, a tool call's arguments) after the
  end-of-reasoning token (`grammar_gate`): the reasoning runs free, the answer is constrained;
- the server splits the output into `reasoning` and `content` (`ReasoningSplit`, fed the same
  way streamed or not) and counts the reasoning tokens in the usage.

Whether an output starts in reasoning is read from its prompt (`thinks`), as vLLM's
`is_reasoning_end`: the last marker of the prompt's final turn (a template that turns thinking off
ends the prompt with an empty `<think>\\n\\n</think>`), and from the template options that turn
thinking off (Qwen 3's `enable_thinking`, GLM's `thinking` too).
An end counts only where its token was generated (text that spells "</think>" in pieces does not
end anything), the same rule as the engine's.

A new parser is one subclass (its markers) and one entry in `REASONING_PARSERS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from . import harmony

if TYPE_CHECKING:
    from .constraints.grammar import GrammarGate
    from .constraints.token_constraints import ThinkingBudget
    from .model.tokenizer import Tokenizer


class ReasoningParser:
    """A family's reasoning markers and rules, bound to a tokenizer's ids (the class attributes
    below are what a subclass sets)."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # tokens that end the reasoning without `end` and begin the answer (kept in the content)
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    # tokens that begin or end a turn: the prompt's scan for a marker stops at them
    turn_boundaries: ClassVar[tuple[str, ...]] = ()
    # chat-template options that turn thinking off: where any is given and none of those given is
    # true, the model answers without reasoning
    thinking_options: ClassVar[tuple[str, ...]] = ()
    # False: the model thinks only where one of `thinking_options` is given and true
    thinks_by_default: ClassVar[bool] = True
    # a further `end` in the answer is dropped (a model that closes its reasoning twice)
    drops_later_ends: ClassVar[bool] = False
    # the reasoning's trailing whitespace (before its end) is not part of it
    strips_trailing_whitespace: ClassVar[bool] = False
    # a `start` generated in the answer begins reasoning again, until the next `end` (interleaved)
    reenters: ClassVar[bool] = False
    # the model opens its reasoning itself, mid-reply: a thinking budget, counted from the reply's
    # start, applies only where the prompt opened it (thinks)
    opens_in_reply: ClassVar[bool] = False
    # further names under which the family's chat template reads an earlier turn's reasoning
    template_reasoning_names: ClassVar[tuple[str, ...]] = ()
    # tokens that end a served reply whatever the checkpoint's EOS says (set by the parser's init)
    reply_stop_ids: frozenset[int] = frozenset()

    def __init__(self, tokenizer: Tokenizer) -> None:
        def token_id(text: str) -> int:
            i = tokenizer.token_to_id(text)
            if i is None:
                raise ValueError(
                    f"--reasoning-parser {self.name}: the tokenizer has no {text!r} token (this parser is for "
                    f"models whose reasoning is delimited by {self.start!r} and {self.end!r})"
                )
            return i

        self.start_id = token_id(self.start)
        self.end_id = token_id(self.end)
        found = [(t, tokenizer.token_to_id(t)) for t in self.implicit_ends]
        self._implicit = [(t, i) for t, i in found if i is not None]  # those this tokenizer has
        self._boundary_ids = frozenset(i for t in self.turn_boundaries if (i := tokenizer.token_to_id(t)) is not None)
        self.special = any(
            added.special and added.content in (self.start, self.end, *self.implicit_ends)
            for added in tokenizer.backend.get_added_tokens_decoder().values()
        )

    def thinks(self, prompt_token_ids: Sequence[int], template_options: Mapping[str, Any] | None = None) -> bool:
        """Whether the output starts in reasoning: not when the template was told not to think,
        nor when the prompt's final turn already ended its reasoning."""
        given = [template_options[o] for o in self.thinking_options if template_options and o in template_options]
        if not any(given) and (given or not self.thinks_by_default):
            return False
        for token in reversed(prompt_token_ids):
            if token == self.end_id:
                return False
            if token == self.start_id or token in self._boundary_ids:
                return True
        return True

    def grammar_gate(self, thinking: bool = True) -> GrammarGate | None:
        """Where a grammar opens in a reply that starts in reasoning (`thinking`), or in one that
        does not (None: at its first token, unless the model opens its reasoning itself)."""
        from .constraints.grammar import GrammarGate  # torch: imported when a grammar needs it

        after, at = frozenset({self.end_id}), frozenset(i for _, i in self._implicit)
        if thinking:
            return GrammarGate(after=after, at=at)
        return GrammarGate(after=after, at=at, first_unless=frozenset({self.start_id})) if self.opens_in_reply else None

    def thinking_budget(self, limit: int) -> ThinkingBudget:
        """vLLM's `thinking_token_budget`: after `limit` reasoning tokens (counted as
        `reasoning_tokens` counts them), the end token is forced."""
        from .constraints.token_constraints import ThinkingBudget

        ends = frozenset({self.end_id, *(i for _, i in self._implicit)})
        return ThinkingBudget(limit=limit, end=self.end_id, ends=ends, start=self.start_id)

    def split(self, thinking: bool) -> ReasoningSplit:
        return ReasoningSplit(self, thinking)

    def reasoning_tokens(self, token_ids: Sequence[int], thinking: bool) -> int:
        """How many of the output's tokens are reasoning: those before its end (and in later
        spans, for parsers that re-enter), the markers not counted."""
        ends = {self.end_id, *(i for _, i in self._implicit)}
        count, inside = 0, thinking
        for token in token_ids:
            if inside:
                if token in ends:
                    inside = False
                else:
                    count += token != self.start_id
            elif self.reenters and token == self.start_id and thinking:
                inside = True
        return count


class ReasoningSplit:
    """One output's reasoning and content as it grows: `update(text, token_ids)` with the whole
    text and tokens so far returns the whole reasoning and content so far. Each only grows, so a
    stream sends what is new of each; a finished output is one call. Each update looks at what
    is new (tokens, the text's tail), not the whole output again: a long reply streams in linear
    time."""

    def __init__(self, parser: ReasoningParser | None, thinking: bool) -> None:
        """`parser` None: no reasoning (`thinking` must be false), all answer."""
        assert parser is not None or not thinking
        self.parser = parser
        self.thinking = thinking
        self._seen = 0  # tokens looked at for an end
        self._ends: list[tuple[str, bool]] = []  # ends generated: (text, explicit), looked for in the text
        self._end: tuple[int, int] | None = None  # (where the reasoning ends, where the content begins) in the text
        self._start_at = -1  # where the start marker is in the text (-1: not up to _start_scanned)
        self._start_scanned = 0
        self._head: str | None = None  # the reasoning before its end, once the end is known
        self._checked = 0  # tokens after the end looked at for a new start (parsers that re-enter)
        self._reentered = False
        self._late_scanned = 0  # content characters looked at for a second end (parsers that drop it)
        self._late_end = False

    def update(self, text: str, token_ids: Sequence[int], finished: bool = False) -> tuple[str, str]:
        """`finished`: the output ends here (a format that reads an unended part differently at
        the end says so; these markers do not)."""
        p = self.parser
        if not self.thinking or p is None:
            return "", text
        if self._end is None:
            new = token_ids[self._seen :]
            self._seen = len(token_ids)
            if p.end_id in new:
                self._ends.append((p.end, True))
            self._ends += [(t, False) for t, i in p._implicit if i in new]
            # an end's text may come a step after its token (characters held back until complete)
            found = [(at, t, explicit) for t, explicit in self._ends if (at := text.find(t)) >= 0]
            if found:
                at, t, explicit = min(found)
                self._end = (at, at + len(t) if explicit else at)
                ends = {p.end_id, *(i for _, i in p._implicit)}
                self._checked = next(k for k, token in enumerate(token_ids) if token in ends) + 1
        if self._end is None:
            return self._reasoning(self._without_start(text)), ""
        cut, content_at = self._end
        if self._head is None:
            self._head = self._without_start(text[:cut])
        reasoning, content = self._head, text[content_at:]
        if p.reenters:
            if not self._reentered:
                self._reentered = p.start_id in token_ids[self._checked :]
                self._checked = len(token_ids)
            if self._reentered:
                more, content = self._spans(content)
                reasoning += more
        if p.drops_later_ends:
            if not self._late_end:
                self._late_end = p.end in content[max(0, self._late_scanned - len(p.end) + 1) :]
                self._late_scanned = len(content)
            if self._late_end:
                content = content.replace(p.end, "")
        return self._reasoning(reasoning), content

    def _spans(self, content: str) -> tuple[str, str]:
        """(the reasoning of the answer's later `start` ... `end` spans, the answer without them);
        a span not yet closed runs to the end."""
        assert self.parser is not None
        start, end = self.parser.start, self.parser.end
        reasoning, answer = [], []
        while (at := content.find(start)) >= 0:
            answer.append(content[:at])
            rest = content[at + len(start) :]
            close = rest.find(end)
            if close < 0:
                reasoning.append(rest)
                return "".join(reasoning), "".join(answer)
            reasoning.append(rest[:close])
            content = rest[close + len(end) :]
        answer.append(content)
        return "".join(reasoning), "".join(answer)

    def _reasoning(self, text: str) -> str:
        """The reasoning's text, without trailing whitespace where the parser says (it only ever
        grows: what is stripped is still the tail)."""
        return text.rstrip() if self.parser is not None and self.parser.strips_trailing_whitespace else text

    def _without_start(self, text: str) -> str:
        """`text` (a prefix of the output's) without its first start marker; the marker's place is
        looked for in the text's new tail only."""
        assert self.parser is not None
        start = self.parser.start
        if self._start_at < 0 and len(text) > self._start_scanned:
            self._start_at = text.find(start, max(0, self._start_scanned - len(start) + 1))
            self._start_scanned = len(text)
        at = self._start_at
        if at < 0 or at + len(start) > len(text):
            return text
        return text[:at] + text[at + len(start) :]


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: `<think>` (often in the prompt already) ... `</think>`."""

    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1 and later hybrids: DeepSeek-R1's rules where the template is told to think
    (`thinking` or `enable_thinking` true), else no reasoning at all."""

    name = "deepseek_v3"
    thinking_options = ("thinking", "enable_thinking")
    thinks_by_default = False


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen 3: `<think>` ... `</think>`, `enable_thinking=False` answers at once, a tool call
    (`<tool_call>`) ends the reasoning where `</think>` was left out, and a second `</think>` is
    dropped."""

    name = "qwen3"
    implicit_ends = ("<tool_call>",)
    drops_later_ends = True
    turn_boundaries = ("<|im_start|>", "<|im_end|>")
    thinking_options = ("enable_thinking",)


class Glm45ReasoningParser(ReasoningParser):
    """GLM-4.5 to 4.7: `<think>` ... `</think>`, `enable_thinking` or `thinking` false answers at
    once, a tool call (`<tool_call>`) ends the reasoning, a `<think>` in the answer begins more
    (interleaved), a stray `</think>` is dropped, the reasoning's trailing whitespace is not kept,
    and the prompt's scan stops at GLM's turns."""

    name = "glm45"
    implicit_ends = ("<tool_call>",)
    turn_boundaries = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
    thinking_options = ("enable_thinking", "thinking")
    drops_later_ends = True
    strips_trailing_whitespace = True
    reenters = True


class Glm47ReasoningParser(Glm45ReasoningParser):
    name = "glm47"  # vLLM's second name of the same parser


class MiniMaxM2ReasoningParser(ReasoningParser):
    """MiniMax-M2: the reasoning comes first without `<think>` (in the prompt) and ends at
    `</think>` or a tool call (`<minimax:tool_call>`); a second `</think>` is dropped, trailing
    whitespace not kept."""

    name = "minimax_m2"
    implicit_ends = ("<minimax:tool_call>",)
    drops_later_ends = True
    strips_trailing_whitespace = True


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (vLLM's `openai_gptoss`): OpenAI's harmony format (harmony.py), whose reply is a run
    of messages on channels - the analysis channel's are the reasoning, the final channel's (and
    commentary without a recipient) the answer, and commentary to a function a tool call, kept in
    the content as its harmony text for the `openai` tool parser. A grammar (structured outputs,
    required tool calls) constrains the final channel's body; `thinking_token_budget`, which would
    have to force a whole header, is refused by name."""

    name = "openai_gptoss"
    start = harmony.CHANNEL
    end = harmony.MESSAGE
    template_reasoning_names = ("thinking",)  # gpt-oss's template renders a tool call's analysis from it

    def __init__(self, tokenizer: Tokenizer) -> None:
        ids = {}
        for marker in harmony.MARKERS:
            i = tokenizer.token_to_id(marker)
            if i is None:
                raise ValueError(
                    f"--reasoning-parser {self.name}: the tokenizer has no {marker!r} token (this parser is for "
                    "gpt-oss's harmony format)"
                )
            ids[marker] = i
        self.start_id, self.end_id = ids[harmony.CHANNEL], ids[harmony.MESSAGE]
        self._implicit, self._boundary_ids = [], frozenset()
        self.special = True  # the text keeps the markers: the split reads them
        # a tool call ends the reply at <|call|>, which gpt-oss's generation_config.json does not
        # list as an EOS (vLLM adds harmony's stop tokens likewise)
        self.reply_stop_ids = frozenset({ids[harmony.CALL], ids[harmony.RETURN]})
        self._specials = frozenset(ids.values())
        self._tokenizer = tokenizer
        final = tokenizer.encode("final", add_special_tokens=False)
        self._final_header = (ids[harmony.CHANNEL], *final, ids[harmony.MESSAGE])

    def thinks(self, prompt_token_ids: Sequence[int], template_options: Mapping[str, Any] | None = None) -> bool:
        return True  # every reply begins with a header; its channel says what the message is

    def grammar_gate(self, thinking: bool = True) -> GrammarGate:
        """The grammar starts with the final channel's body: after `<|channel|>final<|message|>`
        in a row (as the tokenizer spells "final"); analysis runs free, a tool call never opens it.
        (Every reply thinks: `thinks`.)"""
        from .constraints.grammar import GrammarGate

        return GrammarGate(after=frozenset(), after_run=self._final_header)

    def thinking_budget(self, limit: int) -> ThinkingBudget:
        raise ValueError(f"thinking_token_budget is not supported with --reasoning-parser {self.name}")

    def split(self, thinking: bool) -> ReasoningSplit:
        return HarmonySplit(self)

    def reasoning_tokens(self, token_ids: Sequence[int], thinking: bool) -> int:
        def decode(ids: Sequence[int]) -> str:
            return self._tokenizer.decode(ids, skip_special_tokens=False)

        return harmony.reasoning_token_count(token_ids, decode, self._specials, self.end_id)


class Gemma4ReasoningParser(ReasoningParser):
    """Gemma 4 (vLLM's `gemma4`): reasoning is a channel, `<|channel>thought\n` ... `<channel|>`,
    that the model opens itself. A reply starts in the answer unless its prompt ends inside an
    open channel (a continued turn), and each generated `<|channel>` begins reasoning again. A tool
    call (`<|tool_call>`) ends the reasoning and stays in the content for the `gemma4` tool
    parser; a `<channel|>` in the answer is dropped; the channel's `thought\n` label is not part
    of the reasoning, and a reply that begins with that label (its opener left out) is reasoning.

    Template options are not read: with `enable_thinking` the model opens the channel itself. A
    grammar (structured outputs) constrains the answer alone: it opens at the reply's first token
    unless that token opens a channel, then where the channel ends (`grammar_gate`).
    `thinking_token_budget` is refused unless the prompt opened the channel."""

    name = "gemma4"
    start = "<|channel>"
    end = "<channel|>"
    implicit_ends = ("<|tool_call>",)
    turn_boundaries = ("<|turn>", "<|tool_response>")
    drops_later_ends = True
    reenters = True
    opens_in_reply = True
    label = "thought\n"

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self.call_id = self._implicit[0][1] if self._implicit else None
        self._label_ids = tuple(tokenizer.encode(self.label))

    def thinks(self, prompt_token_ids: Sequence[int], template_options: Mapping[str, Any] | None = None) -> bool:
        """Whether the prompt ends inside an open channel: its last marker, in its final turn, is
        `<|channel>`."""
        stops = {self.end_id, *self._boundary_ids, *(i for _, i in self._implicit)}
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return True
            if token in stops:
                return False
        return False

    def split(self, thinking: bool) -> ReasoningSplit:
        return ChannelSplit(self, thinking)

    def reasoning_tokens(self, token_ids: Sequence[int], thinking: bool) -> int:
        """Tokens inside a channel (a reply that begins with the label: from its start), the
        markers not counted."""
        inside = thinking or tuple(token_ids[: len(self._label_ids)]) == self._label_ids
        count = 0
        for token in token_ids:
            if token == self.start_id:
                inside = True
            elif token == self.end_id or token == self.call_id:
                inside = False
            elif inside:
                count += 1
        return count


class ChannelSplit(ReasoningSplit):
    """Gemma 4's reply as reasoning and content (Gemma4ReasoningParser's rules): a walk over the
    text from marker to marker, each marker taken where its token was generated (its text found
    after the last one taken); what follows the last marker is the open span's, so each part only
    grows."""

    def __init__(self, parser: Gemma4ReasoningParser, thinking: bool) -> None:
        super().__init__(parser, thinking)
        self.gemma = parser
        self._inside = thinking
        self._decided = thinking  # whether a leading label has been looked for
        self._pos = 0  # text walked: the markers before it taken
        self._parts = {True: "", False: ""}  # reasoning (True) and content (False) before _pos
        markers = [parser.start, parser.end] + [t for t, _ in parser._implicit]
        self._ids = {parser.start_id: parser.start, parser.end_id: parser.end, **{i: t for t, i in parser._implicit}}
        self._pending = dict.fromkeys(markers, 0)  # tokens generated whose text is not yet taken
        self._scanned = dict.fromkeys(markers, 0)  # no marker's text begins before its entry

    def update(self, text: str, token_ids: Sequence[int], finished: bool = False) -> tuple[str, str]:
        p = self.gemma
        for token in token_ids[self._seen :]:
            if token in self._ids:
                self._pending[self._ids[token]] += 1
        self._seen = len(token_ids)
        if not self._decided:  # a reply that begins with the channel's label is reasoning
            if text.startswith(p.label):
                self._inside = self._decided = True
            elif p.label.startswith(text) and not finished:
                return "", ""
            else:
                self._decided = True
        while found := self._next_marker(text):
            at, marker = found
            self._parts[self._inside] += text[self._pos : at]
            self._pos = at + len(marker)
            self._pending[marker] -= 1
            if marker == p.start:
                self._inside = True
            elif marker == p.end:
                self._inside = False  # (a stray one in the answer is dropped)
            else:  # a tool call: the answer's, marker and all
                self._inside = False
                self._parts[False] += marker
        reasoning, content = self._parts[True], self._parts[False]
        if self._inside:
            reasoning += text[self._pos :]
        else:
            content += text[self._pos :]
        return self._without_label(reasoning, finished), content

    def _next_marker(self, text: str) -> tuple[int, str] | None:
        """The first marker after the walk whose token was generated, or None. Each marker's
        search resumes where its last one left off: a stream is walked in linear time."""
        best: tuple[int, str] | None = None
        for marker, pending in self._pending.items():
            if pending <= 0:
                continue
            at = text.find(marker, max(self._pos, self._scanned[marker]))
            self._scanned[marker] = at if at >= 0 else max(0, len(text) - len(marker) + 1)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker)
        return best

    def _without_label(self, reasoning: str, finished: bool) -> str:
        label = self.gemma.label
        if reasoning.startswith(label):
            return reasoning[len(label) :]
        if label.startswith(reasoning) and (not finished or reasoning == label.rstrip()):
            return ""  # may yet be the label: held back
        return reasoning


class HarmonySplit(ReasoningSplit):
    """A harmony reply's (reasoning, content) as it grows, each only growing: the messages' texts
    joined by newlines (vLLM's joining; empty ones left out), tool calls' messages in the content
    as harmony text (`harmony.tool_call_text`), builtin tools' left out. A reply that ends inside
    a header gives that header's text as content (vLLM's recovery of a reply that is not harmony)."""

    def __init__(self, parser: GptOssReasoningParser) -> None:
        super().__init__(parser, True)
        self._reply = harmony.HarmonyReply()

    def update(self, text: str, token_ids: Sequence[int], finished: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        content, visible = "", False  # visible: some answer text is in the content
        for m in self._reply.update(text):
            kind = m.kind
            if kind == "reasoning" and m.text:
                reasoning.append(m.text)
            elif kind == "content" and m.text:
                content += ("\n" if visible else "") + m.text
                visible = True
            elif kind == "tool":
                content += harmony.tool_call_text(m)
        if finished and self._reply.unparsed:
            content += ("\n" if visible else "") + self._reply.unparsed
        return "\n".join(reasoning), content


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p
    for p in (
        DeepSeekR1ReasoningParser,
        DeepSeekV3ReasoningParser,
        Qwen3ReasoningParser,
        Glm45ReasoningParser,
        Glm47ReasoningParser,
        MiniMaxM2ReasoningParser,
        GptOssReasoningParser,
        Gemma4ReasoningParser,
    )
}
