"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

from fastapi import Request

from ..multimodal.chat import chat_prompt_with_images, has_image_parts
from ..outputs import RequestOutput
from ..reasoning import ReasoningSplit
from ..sampling_params import SamplingParams
from .beam_search import beam_search_params, beam_usage, check_beam_fields, run_beam_search
from .errors import APIError
from .logprobs import chat_logprobs
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionTokensDetails,
    DeltaMessage,
    PromptLogprobs,
    UsageInfo,
    random_id,
)
from .serving import OpenAIServing, log_no_effect_field_once
from .streaming import ChoiceDelta, StreamState, chunk_dict, sse_stream
from .tools import ToolPlan, ToolStream, finish_for, plan_tools


class OpenAIServingChat(OpenAIServing):
    tool_parser: str | None = None  # --tool-call-parser, when --enable-auto-tool-choice (set by create_app)
    response_role: str = "assistant"  # --response-role (set by create_app)

    def role_for(self, req: Any) -> str:
        """The reply's role, as vLLM: --response-role when the prompt asks for a new turn, else the
        role of the message being continued."""
        if req.add_generation_prompt and not req.continue_final_message:
            return self.response_role
        return req.messages[-1].role if req.messages else self.response_role

    def echoed(self, req: Any) -> str:
        """vLLM's chat `echo`: the last message's text when it has the reply's role (a continued
        final message), which the reply then starts with; else nothing."""
        if not req.echo or not req.messages or req.messages[-1].role != self.role_for(req):
            return ""
        content = req.messages[-1].content
        return self.message_text(content, f"messages[{len(req.messages) - 1}].content") if content else ""

    def message_text(self, content: object, at: str) -> str:
        """A message's content as text: a string, or a list of text parts (joined by newlines)."""
        if content is None:
            return ""
        if isinstance(content, str):
            self.check_text(content, "messages")
            return content
        parts = []
        for j, part in enumerate(cast("list[Any]", content)):
            where = f"{at}.content[{j}]"
            if not isinstance(part, dict):
                raise APIError(
                    f"{where} must be an object with a type, got {type(part).__name__}", 400, param="messages"
                )
            kind = part.get("type", "text")
            if kind != "text":
                raise APIError(
                    f"{where}: content part type {kind!r} is not supported (text only)", 400, param="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(f"{where}.text must be a string, got {type(text).__name__}", 400, param="messages")
            self.check_text(text, "messages")
            parts.append(text)
        return "\n".join(parts)

    def template_options(self, req: Any) -> dict[str, Any]:
        """The keyword arguments the chat template gets besides the messages (its tools aside):
        `chat_template_kwargs` and the request fields templates read, checked."""
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "chat_template", "continue_final_message", "tokenize"):
            if reserved in kwargs:
                raise APIError(
                    f"chat_template_kwargs must not set {reserved!r}: it is a request field of its own",
                    400,
                    param="chat_template_kwargs",
                )
        for field in ("reasoning_effort", "documents"):  # request fields the template reads, as vLLM hands them
            value = getattr(req, field, None)
            if value is None:
                continue
            if field in kwargs and kwargs[field] != value:
                raise APIError(f"{field} and chat_template_kwargs[{field!r}] disagree", 400, param=field)
            kwargs[field] = value
        if getattr(req, "reasoning_effort", None) is not None:
            # vLLM's opt-in for templates that think only when asked (Qwen 3, Gemma 4): unless given
            kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
        return kwargs

    def thinks(self, req: Any, prompt_ids: list[int]) -> bool | None:
        """With --reasoning-parser: whether the reply starts in reasoning (its template options and
        prompt say); None without a parser. The engine's grammar and the reply's split read this one
        answer."""
        parser = self.inputs.reasoning
        if parser is None:
            if getattr(req, "include_reasoning", True) is False:
                log_no_effect_field_once("include_reasoning", "no --reasoning-parser: no reasoning to leave out")
            return None
        return parser.thinks(prompt_ids, self.template_options(req))

    def renderer(self, req: Any, plan: ToolPlan | None = None):
        """The request's messages -> prompt text: its template (the request's `chat_template`,
        else the model's) with its options, as vLLM renders them. Options are checked here."""
        if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise APIError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                400,
                param="continue_final_message",
            )
        if req.chat_template is not None:
            self.check_text(req.chat_template, "chat_template")
        kwargs = self.template_options(req)
        if plan is not None:
            kwargs["tools"] = plan.tools

        def render(messages: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(  # type: ignore[return-value]
                messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                tokenize=False,
                chat_template=req.chat_template,
                continue_final_message=req.continue_final_message,
                **kwargs,
            )

        return render

    async def prompt(self, req: Any, plan: ToolPlan | None = None) -> tuple[list[int], tuple]:
        """The prompt's token ids, and its multimodal items when messages have image parts.
        `req`: a chat request, or /tokenize's chat form (the same fields)."""
        raw = [m.model_dump(exclude_none=True) for m in req.messages]
        if not raw:
            raise APIError("messages must not be empty", 400, param="messages")
        for i, d in enumerate(raw):
            self.reasoning_of_message(d, i)
        render = self.renderer(req, plan)

        if has_image_parts(raw):
            return await self.prompt_with_images(req, raw, render)
        messages = []
        for i, (m, d) in enumerate(zip(req.messages, raw)):
            d["content"] = self.message_text(m.content, f"messages[{i}]")
            messages.append(d)
        try:
            text = render(messages)
        except Exception as e:  # template errors (e.g. raise_exception in the template) are the caller's
            param = "chat_template" if req.chat_template is not None else "messages"
            raise APIError(f"chat template failed: {type(e).__name__}: {e}", 400, param=param) from e
        self.check_text(text, "messages")
        return await self.tokenize(text, req.add_special_tokens), ()

    def reasoning_of_message(self, message: dict[str, Any], index: int) -> None:
        """An assistant message's earlier reasoning (`reasoning`, or the older `reasoning_content`)
        reaches the template under both names, as vLLM hands it (templates that interleave
        thinking with tool calls read `reasoning_content`), and under the names the reasoning
        parser's family reads (gpt-oss's `thinking`)."""
        if message.get("role") != "assistant":
            return
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is None:
            return
        if not isinstance(reasoning, str):
            raise APIError(f"messages[{index}].reasoning must be a string", 400, param="messages")
        self.check_text(reasoning, "messages")
        message["reasoning"] = message["reasoning_content"] = reasoning
        parser = self.inputs.reasoning
        for name in parser.template_reasoning_names if parser is not None else ():
            message.setdefault(name, reasoning)

    async def prompt_with_images(
        self, req: ChatCompletionRequest, messages: list[dict], render
    ) -> tuple[list[int], tuple]:
        """Image parts (data URLs; local files under --allowed-local-media-path; never the network):
        decoded, templated, expanded to placeholders and hashed in a worker thread."""
        inputs = self.inputs
        if req.continue_final_message:
            raise APIError("continue_final_message with image parts is not supported", 400, param="messages")
        for m in messages:
            content = m.get("content")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    self.check_text(part["text"], "messages")

        def build() -> tuple[list[int], tuple]:
            text, images = chat_prompt_with_images(
                messages, render, inputs.image_token, inputs.config.allowed_local_media_path, inputs.max_images
            )
            ids = self.tokenizer.encode(text, req.add_special_tokens)
            return inputs.process_multimodal(ids, {"image": images})

        try:
            return await asyncio.to_thread(build)
        except ValueError as e:  # bad images, URLs, counts: the caller's
            raise APIError(str(e), 400, param="messages") from e

    async def admit(self, req: ChatCompletionRequest) -> tuple[list[int], tuple, SamplingParams, ToolPlan | None]:
        """A chat request's checks, prompt tokens (and image items), sampling parameters (grammar
        compiled) and tool plan: everything before the engine. /v1/responses admits through here too."""
        ids, mm_items, plan, max_tokens = await self.admit_prompt(req)
        params = self.params(req, max_tokens)
        if plan is not None and plan.structured_outputs is not None:  # required / named: the call's grammar
            if params.structured_outputs is not None:
                raise APIError(
                    f'tool_choice "{plan.mode}" cannot be combined with response_format / structured_outputs', 400
                )
            params.structured_outputs = plan.structured_outputs
        if plan is not None and plan.parser is not None and plan.parser.keeps_special_tokens:
            params.skip_special_tokens = False  # the parser reads a special token (mistral's [TOOL_CALLS])
        if self.inputs.reasoning is not None and self.inputs.reasoning.special:
            params.skip_special_tokens = False  # the reasoning's markers are special tokens of this tokenizer
        if self.inputs.reasoning is not None and self.inputs.reasoning.reply_stop_ids:
            params.stop_token_ids = sorted(set(params.stop_token_ids or ()) | self.inputs.reasoning.reply_stop_ids)
        await self.compile_grammar(params)
        return ids, mm_items, params, plan

    async def admit_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], tuple, ToolPlan | None, int]:
        """The checks, prompt tokens, image items, tool plan and max_tokens (beam search stops here)."""
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= self.limits.max_logprobs:
            raise APIError(
                f"top_logprobs must be in [0, {self.limits.max_logprobs}], got {req.top_logprobs}",
                400,
                param="top_logprobs",
            )
        self.check_common(req)
        check_beam_fields(req)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError("prompt_logprobs is not supported with streaming chat", 400, param="prompt_logprobs")
        plan = plan_tools(req.tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls)
        ids, mm_items = await self.prompt(req, plan)
        if req.truncate_prompt_tokens is not None and mm_items:
            raise APIError(
                "truncate_prompt_tokens with image parts is not supported (it would cut image placeholders)",
                400,
                param="truncate_prompt_tokens",
            )
        ids = self.truncate(ids, req)
        max_tokens = self.check_length(ids, req.requested_max_tokens(), "messages")
        return ids, mm_items, plan, max_tokens

    async def create(self, req: ChatCompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.use_beam_search:
            ids, mm_items, _, max_tokens = await self.admit_prompt(req)
            if mm_items:
                raise APIError("image parts are not supported with use_beam_search", 400, param="messages")
            return await self.beam_search(req, raw, ids, max_tokens, model)
        ids, mm_items, params, plan = await self.admit(req)
        rid = req.request_id or random_id("chatcmpl")
        created = int(time.time())
        k = req.top_logprobs or 0
        await self.check_pin(req, [ids])
        lora = self.lora_for(req.model)
        thinks = self.thinks(req, ids)
        gens = self.start(
            [ids],
            [None],
            params,
            rid,
            req.cache_salt,
            lora,
            stream=bool(req.stream),
            mm_items=[mm_items],
            priority=req.priority,
            cache_priority=req.cache_priority,
            thinks=thinks,
        )
        if req.stream:
            return self.stream(req, gens, [ids], rid, created, model, params.n, k, plan, thinks)
        finals = await self.collect(raw, gens)
        pinned = await self.pin_prompts([ids], req.cache_salt, lora) if req.pin else None
        out = finals[0]
        choices = []
        echo = self.echoed(req)
        shown = self.shows_tokens(req)  # hidden reasoning hides the tokens that spell it too
        for o in out.outputs:
            reasoning, text = self.split(req, thinks, o.text, o.token_ids)
            content, calls = plan.parse(text or "") if plan is not None else (text, [])
            if echo:
                content = echo + (content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=o.index,
                    message=ChatResponseMessage(
                        role=self.role_for(req), content=content, tool_calls=calls or None, reasoning=reasoning
                    ),
                    logprobs=chat_logprobs(o.logprobs, o.token_ids, k, self.tokens_as_ids(req))
                    if req.logprobs and o.logprobs is not None and shown
                    else None,
                    finish_reason=finish_for(plan, o.finish_reason, bool(calls)) if plan else o.finish_reason,
                    stop_reason=o.stop_reason,
                    token_ids=list(o.token_ids) if req.return_token_ids and shown else None,
                )
            )
        return ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=self.with_reasoning_tokens(self.usage([ids], finals, pinned), finals, thinks),
            prompt_logprobs=cast("PromptLogprobs", out.prompt_logprobs),
            prompt_token_ids=ids if req.return_token_ids else None,
        )

    def split(self, req: Any, thinks: bool | None, text: str, token_ids: list[int]) -> tuple[str | None, str | None]:
        """A finished reply's (reasoning, content): all content without --reasoning-parser;
        reasoning None when empty or not asked for (`include_reasoning: false`)."""
        parser = self.inputs.reasoning
        if parser is None or thinks is None:
            return None, text
        reasoning, content = parser.split(thinks).update(text, token_ids, finished=True)
        return (reasoning or None) if req.include_reasoning else None, content or None

    def shows_tokens(self, req: Any) -> bool:
        """Whether logprobs and token ids may be returned: not where they would show a reasoning
        the request asked to leave out (as vLLM)."""
        return req.include_reasoning or self.inputs.reasoning is None

    def with_reasoning_tokens(self, usage: UsageInfo, outs: dict[int, RequestOutput], thinks: bool | None) -> UsageInfo:
        """vLLM's `completion_tokens_details.reasoning_tokens`, with --reasoning-parser."""
        parser = self.inputs.reasoning
        if parser is None or thinks is None:
            return usage
        count = sum(parser.reasoning_tokens(o.token_ids, thinks) for out in outs.values() for o in out.outputs)
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)
        return usage

    async def beam_search(
        self, req: ChatCompletionRequest, raw: Request, ids: list[int], max_tokens: int, model: str
    ) -> ChatCompletionResponse:
        """use_beam_search: n beams as n choices, best first (server/beam_search.py)."""
        params = beam_search_params(req, max_tokens, self)
        rid = req.request_id or random_id("chatcmpl")
        lora = self.lora_for(req.model)
        beams, cached = await run_beam_search(
            self, raw, [ids], params, rid, req.cache_salt, lora, req.priority, req.skip_special_tokens
        )
        thinks, shown = self.thinks(req, ids), self.shows_tokens(req)
        choices = []
        for j, b in enumerate(beams[0]):
            reasoning, content = self.split(req, thinks, b.text, b.token_ids)
            choices.append(
                ChatCompletionResponseChoice(
                    index=j,
                    message=ChatResponseMessage(content=content, reasoning=reasoning),
                    logprobs=chat_logprobs(b.logprobs, b.token_ids, req.top_logprobs or 0, self.tokens_as_ids(req))
                    if req.logprobs and shown
                    else None,
                    finish_reason=b.finish_reason,
                    stop_reason=b.stop_reason,
                    token_ids=b.token_ids if req.return_token_ids and shown else None,
                )
            )
        usage = beam_usage([ids], beams, cached)
        return ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=usage, prompt_token_ids=ids if req.return_token_ids else None
        )

    def stream(self, req, gens, prompts, rid, created, model, n, k, plan=None, thinks=None):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def response(choices, usage=None, prompt_ids=None) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=rid, created=created, model=model, choices=choices, usage=usage, prompt_token_ids=prompt_ids
            )

        tools = ToolStream(plan) if plan is not None else None
        as_ids = self.tokens_as_ids(req)
        parser, shown = self.inputs.reasoning, self.shows_tokens(req)
        splits: dict[int, ReasoningSplit] = {}  # by choice: its reasoning and content so far
        sent: dict[int, tuple[int, int]] = {}  # by choice: characters of each sent

        def make_chunk(d: ChoiceDelta, state: StreamState) -> dict:
            lp = None
            if req.logprobs and d.logprobs is not None and shown:
                lp = chat_logprobs(d.logprobs, d.token_ids, k, as_ids)
            text, reasoning = d.choice.text, None
            new: str | None = d.text
            if parser is not None and thinks is not None:  # the same split as a whole reply's, as it grows
                split = splits.get(d.index) or splits.setdefault(d.index, parser.split(thinks))
                thought, text = split.update(d.choice.text, d.choice.token_ids, d.choice.finish_reason is not None)
                sent_thought, sent_text = sent.get(d.index, (0, 0))
                sent[d.index] = (len(thought), len(text))
                reasoning = (thought[sent_thought:] or None) if req.include_reasoning else None
                new = text[sent_text:] or None
            delta, finish = DeltaMessage(content=new, reasoning=reasoning), d.choice.finish_reason
            if tools is not None:  # content up to where a call may begin; the calls when the choice ends
                content, calls, finish = tools.delta(d.index, text, finish)
                delta = DeltaMessage(content=content, tool_calls=calls, reasoning=reasoning)
            choice = ChatCompletionStreamChoice(
                index=d.index,
                delta=delta,
                logprobs=lp,
                finish_reason=finish,
                stop_reason=d.choice.stop_reason,
                token_ids=d.new_token_ids if req.return_token_ids and shown else None,
            )
            usage = None
            if continuous:
                usage = self.with_reasoning_tokens(self.usage(prompts, state.latest), state.latest, thinks)
            return chunk_dict(response([choice], usage))

        # the role comes first, one chunk per choice, as OpenAI streams it
        prelude = [
            chunk_dict(
                response(
                    [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role=self.role_for(req), content=""))],
                    self.usage(prompts, {}) if continuous else None,
                    prompts[0] if req.return_token_ids else None,  # as vLLM: on the first chunk
                )
            )
            for i in range(n)
        ]
        echo = self.echoed(req)
        if echo:  # then the echoed text, a chunk per choice, as vLLM streams it
            prelude += [
                chunk_dict(response([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echo))]))
                for i in range(n)
            ]

        def usage_chunk(state: StreamState) -> dict:
            return response(
                [], self.with_reasoning_tokens(self.usage(prompts, state.finals), state.finals, thinks)
            ).model_dump()

        return sse_stream(
            gens,
            n,
            make_chunk,
            prelude=prelude,
            usage_chunk=usage_chunk if include_usage else None,
            on_error=self.count_error,
        )
