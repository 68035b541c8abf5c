"""What every OpenAI route shares: model names, prompt checks, request limits, sampling
parameters, starting the engine requests of one HTTP request, and waiting for them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from ..engine.llm_engine import LLMEngine
from ..lora.request import LoRARequest
from ..outputs import RequestOutput
from ..request import MultiModalItem
from ..sampling_params import RequestOutputKind, SamplingParams, truncate_prompt_tokens
from .async_engine import AsyncEngine
from .errors import APIError
from .limits import RequestLimits
from .lora import LoRARegistry
from .protocol import PromptTokensDetails, UsageInfo, no_effect_fields, unsupported_fields
from .request_logger import RequestLogger
from .streaming import merge, raise_if_failed
from .unicode_check import refuse_unencodable

logger = logging.getLogger("prefixkv.server")
_logged_fields: set[str] = set()


def log_no_effect_field_once(name: str, why: str) -> None:
    """One log line per field name per process: a client sends them on every request."""
    if name not in _logged_fields:
        _logged_fields.add(name)
        logger.info("request field %r accepted; it changes nothing here (%s)", name, why)


class OpenAIServing:
    def __init__(
        self,
        engine: LLMEngine,
        async_engine: AsyncEngine,
        served_model_names: list[str],
        limits: RequestLimits,
        count_error: Callable[[int], Any],
        tokens_as_ids: bool = False,
    ) -> None:
        self.engine = engine
        self.tokens_as_ids_default = tokens_as_ids  # --return-tokens-as-token-ids
        self.async_engine = async_engine
        self.names = served_model_names
        self.limits = limits
        self.count_error = count_error
        self.loras: LoRARegistry | None = None  # set by create_app when LoRA is on
        self.request_logger: RequestLogger | None = None  # set by create_app (--enable-log-requests)
        self.inputs = async_engine.input_processor  # admission, outside the engine thread
        self.tokenizer = self.inputs.tokenizer
        self.max_model_len = self.inputs.max_model_len
        # The longest text one token can stand for: a prompt longer than the context times this
        # cannot fit, so it is refused before it is tokenized (a 50 MB prompt costs nothing).
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)

    def tokens_as_ids(self, req: Any) -> bool:
        """Whether the request's logprobs name tokens `token_id:N`: its own field, else the server's."""
        own = getattr(req, "return_tokens_as_token_ids", None)
        return self.tokens_as_ids_default if own is None else bool(own)

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The name to answer with: a served model name, or a LoRA adapter's (see lora_for)."""
        if self.loras is not None and self.loras.get(model) is not None:
            return model  # type: ignore[return-value]
        if model is not None and model not in self.names:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
        return self.names[0]

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model) if self.loras is not None else None

    def check_fields(self, req: Any) -> None:
        """What every route refuses before any work: text that cannot be written back, fields
        prefixkv does not implement, and a missing salt where the server requires one."""
        refuse_unencodable(req)
        refused = unsupported_fields(req.model_extra)
        if refused:
            name, why = refused[0]
            others = f" (also: {', '.join(n for n, _ in refused[1:])})" if len(refused) > 1 else ""
            raise APIError(f"unsupported field {name!r}: {why}{others}", 400, param=name)
        try:
            accepted = no_effect_fields(req.model_extra)
        except ValueError as e:
            raise APIError(str(e), 400, param=str(e).split()[0]) from e
        if getattr(req, "user", None) is not None:
            accepted.append(("user", "no per-user accounting here"))
        for name, why in accepted:
            log_no_effect_field_once(name, why)
        if self.limits.require_cache_salt and not req.cache_salt:
            raise APIError(
                "this server requires a cache_salt on every request (--require-cache-salt): "
                "requests without one could observe other tenants' cached prompts through timing",
                400,
                param="cache_salt",
            )

    def check_common(self, req: Any) -> None:
        """The generation routes' limits, after `check_fields`."""
        self.check_fields(req)
        if getattr(req, "best_of", None) not in (None, 1):
            raise APIError("best_of is not supported (vLLM v1 dropped it too); use n", 400, param="best_of")
        if isinstance(req.n, bool) or not 1 <= req.n <= self.limits.max_n:
            raise APIError(f"n must be an integer in [1, {self.limits.max_n}], got {req.n!r}", 400, param="n")
        if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= self.limits.max_logprobs:
            raise APIError(
                f"prompt_logprobs must be in [0, {self.limits.max_logprobs}], got {req.prompt_logprobs}",
                400,
                param="prompt_logprobs",
            )

    def check_text(self, text: str, param: str) -> None:
        """Text a tokenizer can take, and short enough to possibly fit the context."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(
                f"{param} is not valid Unicode text: {e.reason} at character {e.start}", 400, param=param
            ) from None
        limit = self.max_model_len * self.max_chars_per_token
        if len(text) > limit:
            raise APIError(
                f"{param} has {len(text)} characters; this model's context of {self.max_model_len} tokens "
                f"holds at most {limit} characters. Please reduce the length of the {param}.",
                400,
                param=param,
            )

    def check_length(self, ids: list[int], max_tokens: int | None, what: str) -> int:
        """Validate a tokenized prompt; return the effective max_tokens."""
        try:
            self.inputs.validate_prompt(ids)
        except ValueError as e:
            if len(ids) >= self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your request has {len(ids)} input tokens ({len(ids)} in the "
                    f"{what}), which leaves no room for the completion. Please reduce the "
                    f"length of the {what}.",
                    400,
                    param="prompt",
                ) from e
            raise APIError(str(e), 400, param="prompt") from e
        if max_tokens is None:
            return self.max_model_len - len(ids)
        if isinstance(max_tokens, int) and max_tokens >= 1 and len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the {what}, "
                f"{max_tokens} in the completion). Please reduce the length of the {what} "
                "or completion.",
                400,
                param="max_tokens",
            )
        return max_tokens

    async def prompt_inputs(
        self, p: Any, add_special_tokens: bool, param: str
    ) -> tuple[list[list[int]], list[str | None]]:
        """A string, a list of strings, token ids or a list of token-id lists -> token ids per
        prompt (and the text of those given as text), checked and tokenized off the event loop."""
        if isinstance(p, str):
            items: list = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise APIError(f"{param} must not be empty", 400, param=param)
        if len(items) > self.limits.max_prompts:
            raise APIError(f"at most {self.limits.max_prompts} prompts per request, got {len(items)}", 400, param=param)
        for it in items:
            if isinstance(it, str):
                self.check_text(it, param)
        ids: list[list[int]] = []
        texts: list[str | None] = []
        for it in items:
            if isinstance(it, str):
                ids.append(await self.tokenize(it, add_special_tokens))
                texts.append(it)
            else:
                ids.append(list(it))
                texts.append(None)
        return ids, texts

    def params(self, req: Any, max_tokens: int | None) -> SamplingParams:
        """The request's SamplingParams; fields it leaves out take the model's defaults
        (--generation-config), and its max_tokens is at most theirs (as vLLM's get_max_tokens)."""
        defaults = self.async_engine.default_sampling_params or {}
        default_max = defaults.get("max_tokens")
        if isinstance(default_max, int) and isinstance(max_tokens, int) and default_max < max_tokens:
            max_tokens = default_max
        try:
            return req.to_sampling_params(max_tokens, defaults)
        except (ValueError, TypeError, OverflowError) as e:
            raise APIError(str(e), 400) from e

    def truncate(self, ids: list[int], req: Any) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context length), or
        its first k with truncation_side "right"."""
        k = getattr(req, "truncate_prompt_tokens", None)
        if k is None:
            return ids
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise APIError(
                f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}", 400, param="truncate_prompt_tokens"
            )
        return truncate_prompt_tokens(ids, k, self.max_model_len, getattr(req, "truncation_side", None) or "left")

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the structured-outputs grammar in a worker thread, so the
        engine loop never waits for a compilation; an invalid schema / regex / grammar is a 400."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.inputs.compile_grammar, params)
        except ValueError as e:
            raise APIError(str(e), 400) from e

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize in a worker thread: a long prompt never stalls other clients' streams."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    # -- running ---------------------------------------------------------------------------
    @staticmethod
    def usage(prompts: list[list[int]], outs: dict[int, RequestOutput], pinned: int | None = None) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for out in outs.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in outs.values())
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, pinned_tokens=pinned),
        )

    def _decode_for_log(self, ids: list[int]) -> str:
        """A prompt that came as token ids (chat), as the log shows it: special tokens kept."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def start(
        self,
        prompts: list[list[int]],
        texts: list[str | None],
        params: SamplingParams,
        response_id: str,
        cache_salt: str | None,
        lora_request: LoRARequest | None = None,
        *,
        stream: bool,
        hidden_states_from: int | None = None,
        priority: int = 0,
        mm_items: list[tuple[MultiModalItem, ...]] | None = None,
        cache_priority: int | None = None,
        thinks: bool | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """One engine request per prompt. The engine's ids are the response id (the client's
        `request_id`, if it sent one, is only displayed) plus a random suffix, so no client can
        name - and so collide with - another request's id, even by sending the same one twice.

        `stream`: the caller reads the outputs as they grow; else only each request's final one
        (`collect`), and the engine is asked for nothing else (FINAL_ONLY, as vLLM's server asks):
        no output built per step, no text decoded token by token unless stop strings need it."""
        if not stream and params.output_kind is not RequestOutputKind.FINAL_ONLY:
            params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        suffix = secrets.token_hex(8)
        ids = [f"{response_id}-{i}-{suffix}" for i in range(len(prompts))]
        if self.request_logger is not None:
            for p, t, rid in zip(prompts, texts, ids):
                lora = lora_request.lora_name if lora_request else None
                self.request_logger.log(rid, t, p, params, lora, decode=self._decode_for_log)
        return [
            self.async_engine.generate(
                p,
                params,
                rid,
                prompt=t,
                cache_salt=cache_salt,
                lora_request=lora_request,
                hidden_states_from=hidden_states_from,
                priority=priority,
                mm_items=mm_items[i] if mm_items else (),
                cache_priority=cache_priority,
                thinks=thinks,
            )
            for i, (p, t, rid) in enumerate(zip(prompts, texts, ids))
        ]

    async def check_pin(self, req: Any, prompts: list[list[int]]) -> None:
        """`pin`: the request's prompt stays cached after it, as POST /v1/cache/pin keeps a prefix.
        Refused with streaming and beam search, and - before anything runs - when the prompts'
        whole blocks could pass the pin bound (--max-pinned-fraction)."""
        if not getattr(req, "pin", False):
            return
        if req.stream:
            raise APIError(
                "pin is not supported with stream (pin the prefix with POST /v1/cache/pin)", 400, param="pin"
            )
        if getattr(req, "use_beam_search", False):
            raise APIError("pin is not supported with use_beam_search", 400, param="pin")

        def room(engine: Any) -> tuple[int, int]:
            pins = engine.kv_cache_manager.pins
            return pins.max_blocks - pins.num_pinned_blocks, engine.config.block_size

        free, block_size = await self.async_engine.call(room)
        need = sum(len(p) // block_size for p in prompts)
        if need > free:
            raise APIError(
                f"pinning the prompt could hold {need} more blocks and {free} are left under the pin bound "
                "(--max-pinned-fraction)",
                400,
                param="pin",
            )

    async def pin_prompts(self, prompts: list[list[int]], cache_salt: str | None, lora: LoRARequest | None) -> int:
        """Pin each prompt's cached whole blocks (after its request ran); the tokens now pinned. A
        pin that cannot be taken any more (its blocks evicted in between, the bound reached by
        another pin) is logged and left out of the count the response reports."""

        def pin_all(engine: Any) -> int:
            pinned = 0
            for ids in prompts:
                try:
                    pinned += int(engine.pins.pin(ids, cache_salt, lora))
                except ValueError as e:
                    logger.warning("a request's pin was not taken: %s", e)
            return pinned

        return int(await self.async_engine.call(pin_all))

    async def collect(self, raw: Request, gens: list[AsyncIterator[RequestOutput]]) -> dict[int, RequestOutput]:
        """Run to completion; a client that goes away aborts the requests."""
        finals: dict[int, RequestOutput] = {}

        async def run() -> None:
            async for i, out in merge(gens):
                raise_if_failed(out)
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    task.result()
                    return finals
                if await raw.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise APIError("client disconnected", 499)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
