"""POST /v1/completions: one or several prompts (text or token ids), streamed or not, with echo,
logprobs and vLLM's prompt_logprobs.

`echo` with `max_tokens: 0` scores a prompt without generating (lm-evaluation-harness's
log-likelihood requests): as vLLM, the engine request runs with max_tokens=1 - its one token is
sampled in the prefill's last step, so no extra forward pass - and the response drops that token:
the choice is the prompt, its logprobs the prompt's, finish_reason "length", no completion tokens."""

from __future__ import annotations

import base64
import time
from dataclasses import replace
from typing import Any, cast

import numpy as np
from fastapi import Request

from ..outputs import RequestOutput
from .beam_search import beam_search_params, beam_usage, check_beam_fields, run_beam_search
from .errors import APIError
from .logprobs import completion_logprobs, echoed_completion_logprobs
from .protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    HiddenStates,
    PromptLogprobs,
    UsageInfo,
    random_id,
)
from .serving import OpenAIServing
from .streaming import ChoiceDelta, StreamState, chunk_dict, sse_stream


def hidden_states_of(hidden: Any) -> HiddenStates | None:
    """A request's hidden states on the wire: float32, row-major, base64."""
    if hidden is None:
        return None
    array = hidden.float().cpu().numpy().astype("<f4", copy=False)
    return HiddenStates(shape=list(array.shape), data=base64.b64encode(np.ascontiguousarray(array).tobytes()).decode())


class OpenAIServingCompletion(OpenAIServing):
    async def prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
        return await self.prompt_inputs(req.prompt, req.add_special_tokens, "prompt")

    def logprobs(
        self,
        out: RequestOutput,
        prompt_ids: list[int],
        echo: bool,
        entries: list,
        token_ids: list[int],
        k: int,
        offset: int,
        as_ids: bool,
    ) -> CompletionLogProbs:
        """Logprobs of generated tokens whose text starts at `offset` of the choice's text, with
        the echoed prompt's tokens first when `echo` is set (the prompt's text goes out with them)."""
        if not echo or out.prompt_logprobs is None:
            return completion_logprobs(entries, token_ids, k, offset, as_ids)
        first = self.tokenizer.decode(prompt_ids[:1])
        return echoed_completion_logprobs(out.prompt_logprobs, first, prompt_ids, entries, token_ids, k, as_ids)

    async def create(self, req: CompletionRequest, raw: Request):
        model = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix is not supported", 400, param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.limits.max_logprobs:
            raise APIError(
                f"logprobs must be in [0, {self.limits.max_logprobs}], got {req.logprobs}", 400, param="logprobs"
            )
        self.check_common(req)
        prompt_only = self.check_prompt_only(req)
        check_beam_fields(req)
        prompts, texts = await self.prompts(req)
        if req.truncate_prompt_tokens is not None:
            cut = [self.truncate(p, req) for p in prompts]
            texts = [t if len(c) == len(p) else None for t, c, p in zip(texts, cut, prompts)]  # echo decodes the cut
            prompts = cut
        max_tokens = req.max_tokens
        for ids in prompts:
            max_tokens = self.check_length(ids, req.max_tokens, "prompt")
        if len(prompts) > 1 and req.max_tokens is None:
            max_tokens = self.max_model_len - max(len(p) for p in prompts)
        if req.use_beam_search:
            room = self.max_model_len - max(len(p) for p in prompts)
            return await self.beam_search(req, raw, prompts, room if max_tokens is None else max_tokens, model)
        params = self.params(req, 1 if prompt_only else max_tokens)
        if req.return_hidden_states:
            if req.stream:
                raise APIError("return_hidden_states is not supported with stream", 400, param="return_hidden_states")
            try:
                params = replace(params, return_hidden_states=True)
            except ValueError as e:
                raise APIError(str(e), 400, param="return_hidden_states") from e
        await self.compile_grammar(params)
        rid = req.request_id or random_id("cmpl")
        created = int(time.time())
        n = params.n
        k = req.logprobs or 0
        echo = [
            (t if t is not None else self.tokenizer.decode(ids)) if req.echo else "" for ids, t in zip(prompts, texts)
        ]
        await self.check_pin(req, prompts)
        lora = self.lora_for(req.model)
        gens = self.start(
            prompts,
            texts,
            params,
            rid,
            req.cache_salt,
            lora,
            stream=bool(req.stream),
            priority=req.priority,
            cache_priority=req.cache_priority,
        )
        if req.stream:
            return self.stream(req, gens, prompts, echo, rid, created, model, n, k, prompt_only)
        finals = await self.collect(raw, gens)
        pinned = await self.pin_prompts(prompts, req.cache_salt, lora) if req.pin else None
        choices = []
        for i in range(len(prompts)):
            out = finals[i]
            for o in out.outputs:
                token_ids, entries = ([], []) if prompt_only else (list(o.token_ids), o.logprobs)
                lp = None
                if req.logprobs is not None and entries is not None:
                    lp = self.logprobs(out, prompts[i], req.echo, entries, token_ids, k, 0, self.tokens_as_ids(req))
                choices.append(
                    CompletionResponseChoice(
                        index=i * n + o.index,
                        text=echo[i] + ("" if prompt_only else o.text),
                        logprobs=lp,
                        finish_reason=_finish_reason(o.finish_reason, prompt_only),
                        stop_reason=None if prompt_only else o.stop_reason,
                        prompt_logprobs=cast("PromptLogprobs", out.prompt_logprobs)
                        if req.prompt_logprobs is not None
                        else None,
                        prompt_token_ids=prompts[i] if req.return_token_ids else None,
                        token_ids=token_ids if req.return_token_ids else None,
                        hidden_states=hidden_states_of(out.hidden_states) if req.return_hidden_states else None,
                    )
                )
        return CompletionResponse(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=self.completion_usage(prompts, finals, prompt_only, pinned),
        )

    @staticmethod
    def check_prompt_only(req: CompletionRequest) -> bool:
        """Whether the request scores its prompt without generating (echo with max_tokens 0);
        max_tokens 0 without echo would answer nothing at all, and is refused as vLLM does."""
        if req.max_tokens != 0:
            return False
        if not req.echo:
            raise APIError(
                "max_tokens must be >= 1, got 0 (max_tokens 0 returns only the prompt: send it with echo=true)",
                400,
                param="max_tokens",
            )
        if req.min_tokens:
            raise APIError(f"min_tokens must be in [0, max_tokens], got {req.min_tokens}", 400, param="min_tokens")
        return True

    def completion_usage(
        self, prompts: list[list[int]], outs: dict[int, RequestOutput], prompt_only: bool, pinned: int | None = None
    ) -> UsageInfo:
        usage = self.usage(prompts, outs, pinned)
        if prompt_only:  # the token the engine sampled is not part of the answer
            usage.completion_tokens = 0
            usage.total_tokens = usage.prompt_tokens
        return usage

    async def beam_search(
        self, req: CompletionRequest, raw: Request, prompts: list[list[int]], max_tokens: int, model: str
    ) -> CompletionResponse:
        """use_beam_search: n beams per prompt, as n choices, best first (server/beam_search.py)."""
        params = beam_search_params(req, max_tokens, self)
        rid = req.request_id or random_id("cmpl")
        lora = self.lora_for(req.model)
        beams, cached = await run_beam_search(
            self, raw, prompts, params, rid, req.cache_salt, lora, req.priority, req.skip_special_tokens
        )
        n = params.beam_width
        choices = [
            CompletionResponseChoice(
                index=i * n + j,
                text=b.text,
                logprobs=completion_logprobs(b.logprobs, b.token_ids, req.logprobs, 0, self.tokens_as_ids(req))
                if req.logprobs is not None
                else None,
                finish_reason=b.finish_reason,
                stop_reason=b.stop_reason,
                prompt_token_ids=prompts[i] if req.return_token_ids else None,
                token_ids=b.token_ids if req.return_token_ids else None,
            )
            for i, prompt_beams in enumerate(beams)
            for j, b in enumerate(prompt_beams)
        ]
        return CompletionResponse(id=rid, model=model, choices=choices, usage=beam_usage(prompts, beams, cached))

    def stream(self, req, gens, prompts, echo, rid, created, model, n, k, prompt_only):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        as_ids = self.tokens_as_ids(req)

        def make_chunk(d: ChoiceDelta, state: StreamState) -> dict:
            i = d.prompt_index
            generated, entries, token_ids, new_ids = d.text, d.logprobs, d.token_ids, d.new_token_ids
            if prompt_only:
                generated, entries, token_ids, new_ids = "", [], [], []
            text = (echo[i] + generated) if d.first and echo[i] else generated
            lp = None
            if req.logprobs is not None and entries is not None:
                offset = d.text_start + (0 if d.first else len(echo[i]))
                lp = self.logprobs(d.output, prompts[i], req.echo and d.first, entries, token_ids, k, offset, as_ids)
            want_prompt_lp = d.first and req.prompt_logprobs is not None
            chunk = CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[
                    CompletionResponseChoice(
                        index=d.index,
                        text=text,
                        logprobs=lp,
                        finish_reason=_finish_reason(d.choice.finish_reason, prompt_only),
                        stop_reason=None if prompt_only else d.choice.stop_reason,
                        prompt_logprobs=cast("PromptLogprobs", d.output.prompt_logprobs) if want_prompt_lp else None,
                        prompt_token_ids=prompts[i] if req.return_token_ids and d.first else None,
                        token_ids=new_ids if req.return_token_ids else None,
                    )
                ],
            )
            if continuous:
                chunk.usage = self.completion_usage(prompts, state.latest, prompt_only)
            return chunk_dict(chunk)

        def usage_chunk(state: StreamState) -> dict:
            return CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[],
                usage=self.completion_usage(prompts, state.finals, prompt_only),
            ).model_dump()

        return sse_stream(
            gens, n, make_chunk, usage_chunk=usage_chunk if include_usage else None, on_error=self.count_error
        )


def _finish_reason(reason: str | None, prompt_only: bool) -> str | None:
    """A prompt-only choice ends at its budget of 0 tokens, whatever its dropped token did."""
    return "length" if prompt_only and reason in ("stop", "length") else reason
