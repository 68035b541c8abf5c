"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions: `n` beams, the search of
prefixkv/engine/beam_search.py driven through the async engine - each step's beams are one-token
requests that find their shared prefix blocks cached.

What a beam search request may carry: `n` (the beam width), `max_tokens`, `ignore_eos`,
`length_penalty`, `temperature` (as in vLLM it changes no score), `include_stop_str_in_output`,
`skip_special_tokens`, `return_token_ids`, logprobs (up to the 2 * n candidates each step ranks),
the prompt's own fields (cache_salt, priority, truncate_prompt_tokens). Any field that would
shape the output another way - sampling filters, penalties, stop conditions, constraints, echo,
prompt logprobs, streaming, `early_stopping` - is refused by name, never ignored."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..engine.beam_search import BeamSearch, check_beam_width, step_params, top_logprobs
from ..lora.request import LoRARequest
from ..outputs import Logprob
from ..sampling_params import BeamSearchParams
from .errors import APIError
from .protocol import PromptTokensDetails, UsageInfo
from .serving import OpenAIServing

# request fields beam search does not implement, with the values that change nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "early_stopping": (False,),
    "echo": (False,),
    "prompt_logprobs": (None,),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "stop": (None, "", []),
    "stop_token_ids": (None, []),
    "min_tokens": (0,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "return_hidden_states": (None, False),
    "tools": (None, []),
}


@dataclass
class BeamChoice:
    """One returned beam as a choice: its output text and tokens, best beam first."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[dict[int, Logprob]]  # per token: the step's top 2 * n candidates


def top_logprobs_asked(req: Any) -> int | None:
    """How many top logprobs a choice carries: completions' `logprobs`, chat's `top_logprobs`
    (when `logprobs` is true); None: no logprobs."""
    if hasattr(req, "top_logprobs"):  # chat
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def check_beam_fields(req: Any) -> None:
    """length_penalty and early_stopping shape beam search only: without it they are refused."""
    if req.use_beam_search:
        return
    if req.length_penalty != 1.0:
        raise APIError("length_penalty applies to beam search only: send use_beam_search", 400, param="length_penalty")
    if req.early_stopping:
        raise APIError("early_stopping applies to beam search only (and is not supported)", 400, param="early_stopping")


def beam_search_params(req: Any, max_tokens: int, serving: OpenAIServing) -> BeamSearchParams:
    """The request's BeamSearchParams (vLLM's to_beam_search_params); fields it leaves out take the
    model's defaults. APIError 400 naming a field beam search does not implement, or a bad value."""
    defaults = serving.async_engine.default_sampling_params or {}
    inputs = serving.inputs
    max_logprobs = min(inputs.config.max_logprobs, inputs.vocab_size)
    for name, neutral in _NEUTRAL.items():
        value = getattr(req, name, None)
        if value is not None and not any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
        ):
            raise APIError(f"{name} is not supported with use_beam_search", 400, param=name)
    if getattr(req, "response_format", None) is not None and req.response_format.type != "text":
        raise APIError("response_format is not supported with use_beam_search", 400, param="response_format")
    default_max = defaults.get("max_tokens")
    if isinstance(default_max, int) and default_max < max_tokens:  # as the sampling path (vLLM's get_max_tokens)
        max_tokens = default_max
    try:
        params = BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=defaults.get("temperature", 1.0) if req.temperature is None else req.temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        check_beam_width(params, max_logprobs)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), 400, param="n" if "beam_width" in str(e) else None) from e
    k = top_logprobs_asked(req)
    if k is not None and k > 2 * params.beam_width:
        name = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
        raise APIError(
            f"{name}={k} with use_beam_search: at most 2 * n = {2 * params.beam_width}, the candidates a step ranks",
            400,
            param=name,
        )
    return params


async def run_beam_search(
    serving: OpenAIServing,
    raw: Request,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    response_id: str,
    cache_salt: str | None,
    lora_request: LoRARequest | None,
    priority: int,
    skip_special_tokens: bool,
) -> tuple[list[list[BeamChoice]], list[int]]:
    """Each prompt's best beams as choices, and each prompt's cached tokens (its first step's
    prefix-cache hit). All live beams of all prompts run as one batch per step; a client that
    goes away aborts the step's requests (`collect`) and no further step starts."""
    inputs = serving.inputs
    eos_ids = inputs.eos_ids
    searches = [BeamSearch(p, params, eos_ids, serving.max_model_len, lora_request) for p in prompts]
    one_step = step_params(params)
    cached = [0] * len(prompts)
    step = 0
    while True:
        work = [(k, beam) for k, s in enumerate(searches) for beam in s.live]
        if not work:
            break
        if step and await raw.is_disconnected():  # `collect` checks only while a step runs long
            raise APIError("client disconnected", 499)
        gens = serving.start(
            [beam.tokens for _, beam in work],
            [None] * len(work),
            one_step,
            f"{response_id}-beam{step}",
            cache_salt,
            lora_request,
            stream=False,
            priority=priority,
        )
        finals = await serving.collect(raw, gens)
        if step == 0:
            for i, (k, _) in enumerate(work):
                cached[k] = finals[i].num_cached_tokens
        tops = iter([top_logprobs(finals[i]) for i in range(len(work))])
        for search in searches:
            if search.live:
                search.advance([next(tops) for _ in search.live])
        step += 1
    decode = serving.tokenizer.decode
    choices = []
    for search in searches:
        beams = []
        for seq in search.best():
            out = seq.tokens[search.prompt_len :]
            # as vLLM: the EOS that ended a beam is in its text and tokens only when asked
            shown = out[:-1] if seq.finish_reason == "stop" and not params.include_stop_str_in_output else out
            reason = seq.finish_reason or "length"
            text = decode(shown, skip_special_tokens)
            beams.append(BeamChoice(text, shown, reason, seq.stop_reason, seq.logprobs[: len(shown)]))
        choices.append(beams)
    return choices, cached


def beam_usage(prompts: Sequence[list[int]], beams: list[list[BeamChoice]], cached: list[int]) -> UsageInfo:
    """Usage as the sampling path counts it: the prompts once, every returned beam's tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(b.token_ids) for prompt_beams in beams for b in prompt_beams)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached)),
    )
