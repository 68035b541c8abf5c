"""The offline API, shaped like vLLM's: a script written for vLLM runs by changing the import.

`LLM(...)` takes `EngineArgs`' keywords (prefixkv/engine_args.py: vLLM's names and defaults,
written once). Anything vLLM accepts that prefixkv does not implement - an engine option, a
prompt field, a generate() or chat() argument - is refused with a ValueError naming it, unless
its value changes nothing here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from .engine.beam_output import BeamSearchOutput
from .engine.beam_search import BeamSearch, check_beam_width, outputs_of, run_beam_search
from .engine.llm_engine import LLMEngine
from .engine_args import EngineArgs
from .multimodal.chat import chat_prompt_with_images, has_image_parts
from .outputs import RequestOutput
from .request import LoRARequest
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from .stage_outputs import EmbeddingRequestOutput, PoolingOutput, PoolingParams, PoolingRequestOutput, pool

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
# a prompt: (text or token ids, its cache_salt, its multi_modal_data, the text its token ids came from)
PromptItem = tuple[str | list[int], str | None, Any, str | None]
# vLLM prompt-dict fields prefixkv does not implement
_UNSUPPORTED_PROMPT_KEYS = {
    "mm_processor_kwargs": "the checkpoint's own image processor settings are used",
    "multi_modal_uuids": "item identities are content hashes (mm_hash), not caller-given ids",
    "prompt_embeds": "prompt embeddings are not implemented",
    "token_type_ids": "token type ids are not implemented",
}
# vLLM generate() / chat() arguments prefixkv does not implement: accepted only when None
_UNSUPPORTED_CALL_ARGS = {
    "guided_options_request": "guided decoding is not implemented",
    "prompt_adapter_request": "prompt adapters are not implemented",
    "tokenization_kwargs": "tokenization options are not implemented",
    "truncate_prompt_tokens": "give it in SamplingParams(truncate_prompt_tokens=...)",
    "documents": "documents are not implemented",
    "mm_processor_kwargs": "the checkpoint's own image processor settings are used",
}


def _refuse_call_args(where: str, kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - set(_UNSUPPORTED_CALL_ARGS))
    if unknown:
        raise TypeError(f"{where}() got unexpected arguments: {', '.join(unknown)}")
    for name, value in kwargs.items():
        if value is not None and value != {}:
            raise ValueError(f"{where}({name}=...) is not supported by prefixkv: {_UNSUPPORTED_CALL_ARGS[name]}")


def _lora_list(lora_request: Any, n: int) -> list[Any]:
    """One LoRARequest (or None) per prompt: a single one applies to all, a list names each."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != n:
            raise ValueError(f"{len(lora_request)} lora requests for {n} prompts")
        return list(lora_request)
    return [lora_request] * n


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """generate() returns each request's final output, whatever its output_kind (as vLLM's LLM):
    the engine is asked for FINAL_ONLY, so it builds no output until a request ends. The caller's
    params are copied, not changed."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params_list:
        if p.output_kind is not RequestOutputKind.FINAL_ONLY:
            if id(p) not in copies:
                copies[id(p)] = p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            p = copies[id(p)]
        out.append(p)
    return out


def _pooling_params(
    params: PoolingParams | None, pooling: str | None, normalize: bool | None, default: PoolingParams
) -> PoolingParams:
    """`pooling_params`, or the `pooling=` / `normalize=` shortcuts (not both) over the engine's
    default (`pooler_config`)."""
    if params is not None:
        if pooling is not None or normalize is not None:
            raise ValueError("give pooling_params or pooling= / normalize=, not both")
        return params
    return PoolingParams(pooling or default.pooling, default.normalize if normalize is None else normalize)


def _as_prompt_list(prompts: Any, prompt_token_ids: Any) -> list[PromptItem]:
    """Each prompt as (text or token ids, its own cache_salt, its multi_modal_data or None, the text
    its token ids came from or None). Dicts are vLLM's TextPrompt / TokensPrompt (prefixkv.inputs)."""
    if prompt_token_ids is not None:
        prompts = prompt_token_ids
    if prompts is None:
        raise ValueError("no prompts given")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]  # one prompt of token ids
    out: list[PromptItem] = []
    for p in prompts:
        salt = mm = text = None
        if isinstance(p, dict):
            for key in p:
                if key in _UNSUPPORTED_PROMPT_KEYS:
                    why = _UNSUPPORTED_PROMPT_KEYS[key]
                    raise ValueError(f"prompt field {key!r} is not supported by prefixkv: {why}")
                if key not in _PROMPT_KEYS:
                    takes = ", ".join(sorted(_PROMPT_KEYS))
                    raise ValueError(f"unknown prompt field {key!r}; a prompt dict takes {takes}")
            salt, mm = p.get("cache_salt"), p.get("multi_modal_data")
            if "prompt_token_ids" in p:
                text = p.get("prompt")  # a TokensPrompt may say what text its ids came from
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(p)}")
        if isinstance(p, str):
            out.append((p, salt, mm, None))
        elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            out.append((list(p), salt, mm, text))
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(p).__name__}")
    if not out:
        raise ValueError("no prompts given")
    return out


class LLM:
    """LLM(model=None, enable_prefix_caching=True, ...): None loads the embedded SmolLM2-135M-Instruct.

    Keywords are `EngineArgs` fields. The KV budget is `kv_cache_memory_bytes` (or `num_blocks`,
    or vLLM's `num_gpu_blocks_override`), not the model's maximum length."""

    _hf_tokenizer: Any = None  # get_tokenizer()'s, built on the first call

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one sharing already loaded weights)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        return llm

    def get_tokenizer(self) -> Any:
        """The tokenizer as a Hugging Face `PreTrainedTokenizerFast` (built on the first call; the
        engine keeps its own): `tok(text)`, `len(tok)`, `apply_chat_template(...)`, as in vLLM."""
        if self._hf_tokenizer is None:
            from .model.hf_tokenizer import to_hf_tokenizer

            self._hf_tokenizer = to_hf_tokenizer(self.llm_engine.tokenizer)
        return self._hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (as vLLM; none with
        generation_config='vllm'). What generate() and chat() use when given no sampling_params."""
        defaults = self.llm_engine.default_sampling_params
        return SamplingParams(**defaults) if defaults else SamplingParams()

    def generate(
        self,
        prompts: Any = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        prompt_token_ids: Any = None,
        cache_salt: str | None = None,
        priority: list[int] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a batch (strings, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": ...} dicts, each with an optional "cache_salt"). Everything is
        validated before anything runs. A request that fails alone comes back finished with
        `error` set; the others are unharmed."""
        _refuse_call_args("generate", kwargs)
        items = _as_prompt_list(prompts, prompt_token_ids)
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise ValueError(f"{len(priorities)} priorities for {len(items)} prompts")
        for p in priorities:  # checked before anything is queued
            self.llm_engine.input_processor.check_priority(p)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"{len(params_list)} sampling params for {len(items)} prompts")
        params_list = _final_only(params_list)
        engine = self.llm_engine
        loras = _lora_list(lora_request, len(items))
        for lora in loras:
            if lora is not None:
                # every adapter validated before anything runs, and read again: changed files load anew
                engine.resolve_lora(lora, reload=True)
        processed = [  # every prompt checked (images decoded, placeholders expanded) before any runs
            engine.input_processor.process(
                item,
                params,
                prompt_text=text,
                lora_request=lora,
                cache_salt=salt if salt is not None else cache_salt,
                priority=prio,
                multi_modal_data=mm,
            )
            for (item, salt, mm, text), params, lora, prio in zip(items, params_list, loras, priorities)
        ]
        ids_in_order: list[str] = []
        try:
            for req in processed:
                ids_in_order.append(engine.add_processed(req))
        except BaseException:
            engine.abort_request(ids_in_order)  # all or nothing
            raise
        return self._run(ids_in_order, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Chat completion for one conversation or a batch, through the model's chat template (or
        `chat_template`); `continue_final_message` continues the last message instead of starting
        a reply (then add_generation_prompt must be False, as vLLM); `tools` and
        `chat_template_kwargs` are passed to the template (as in vLLM, the replies are not parsed
        for tool calls: the server does that). Each output's `prompt` is the rendered text."""
        _refuse_call_args("chat", kwargs)
        if tools is not None:
            if chat_template_kwargs and "tools" in chat_template_kwargs:
                raise ValueError("chat(tools=...) and chat_template_kwargs['tools'] are both given")
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        if continue_final_message and add_generation_prompt:
            raise ValueError("chat(continue_final_message=True) needs add_generation_prompt=False, as in vLLM")
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(
                f"chat(chat_template_content_format={chat_template_content_format!r}) is not "
                "supported by prefixkv: message contents are strings"
            )
        conversations = cast(
            "list[list[dict[str, Any]]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        tok = self.llm_engine.tokenizer  # the engine's own (get_tokenizer() builds transformers')
        inputs = self.llm_engine.input_processor

        def render(conv: list[dict]) -> str:
            return tok.apply_chat_template(  # type: ignore[return-value]
                conv,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=chat_template,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )

        prompts: list[dict[str, Any]] = []
        texts: list[str] = []
        for conv in conversations:
            if has_image_parts(conv):  # image_url / image_pil parts (prefixkv/multimodal/chat.py)
                text, images = chat_prompt_with_images(
                    conv, render, inputs.image_token, inputs.config.allowed_local_media_path, inputs.max_images
                )
                ids = tok.encode(text, add_special_tokens=False)
                prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
            else:
                text = render(conv)
                prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
            texts.append(text)
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request, priority=priority)
        for out, text in zip(outs, texts):
            out.prompt = text  # as vLLM: the rendered conversation
        return outs

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (prefixkv/engine/beam_search.py): for each prompt (a string, token
        ids or a {"prompt"/"prompt_token_ids", "cache_salt"} dict) the best `params.beam_width`
        sequences, best first; each sequence's `tokens` and `text` hold the prompt and the output.
        Every step's beams share their cached prefix blocks. `concurrency_limit`: how many prompts
        are searched at once (None: all)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"beam_search() params must be a BeamSearchParams, got {type(params).__name__}")  # noqa: TRY004
        engine = self.llm_engine
        inputs = engine.input_processor
        check_beam_width(params, min(engine.config.max_logprobs, inputs.vocab_size))
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or isinstance(concurrency_limit, bool) or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        items = _as_prompt_list(prompts, None)
        if any(mm is not None for _, _, mm, _ in items):
            raise ValueError("beam_search() of prompts with multi_modal_data is not supported by prefixkv")
        loras = _lora_list(lora_request, len(items))
        for lora in loras:
            if lora is not None:
                engine.resolve_lora(lora, reload=True)
        token_ids = [inputs.tokenize(p) if isinstance(p, str) else p for p, _, _, _ in items]
        for ids in token_ids:  # every prompt checked before any runs
            inputs.validate_prompt(ids)
        searches = [
            BeamSearch(ids, params, engine.eos_ids, engine.max_model_len, lora) for ids, lora in zip(token_ids, loras)
        ]
        salts = [salt for _, salt, _, _ in items]
        batch = concurrency_limit or len(searches)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(searches), desc="Beam search", dynamic_ncols=True)
        try:
            for start in range(0, len(searches), batch):
                run_beam_search(engine, searches[start : start + batch], params, salts[start : start + batch])
                if bar is not None:
                    bar.update(len(searches[start : start + batch]))
        finally:
            if bar is not None:
                bar.close()
        tok = engine.tokenizer
        return outputs_of(searches, lambda ids: tok.decode(ids, skip_special_tokens=False))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))  # an interrupt or a failure leaves no blocks held
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]

    def reset_prefix_cache(self, keep_pinned: bool = False) -> bool:
        """Forget the cached prefixes (refused, False, while requests run); pinned prefixes are
        dropped too unless `keep_pinned`."""
        return self.llm_engine.reset_prefix_cache(keep_pinned)

    # -- pinned prefixes: kept cached under any load (prefixkv/cache/pins.py) ---------------------
    def pin_prefix(
        self,
        prefix: str | list[int] | list[dict],
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
    ) -> int:
        """Compute `prefix` (a text, token ids, or chat messages such as a system prompt) once and
        keep its KV blocks cached until `unpin_prefix` - no eviction under any load. Returns the
        tokens pinned (its whole blocks). A prefix is per tenant (`cache_salt`) and per adapter,
        as its blocks are. Refused (PinError, a ValueError) past `max_pinned_fraction` of the
        cache."""
        ids = self.llm_engine.pins.token_ids(prefix, chat_template)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        out = self.generate({"prompt_token_ids": ids}, params, False, lora_request, cache_salt=cache_salt)[0]
        if out.error is not None:
            raise ValueError(f"the prefix could not be computed: {out.error}")
        return self.llm_engine.pins.pin(ids, cache_salt, lora_request)

    def unpin_prefix(
        self,
        prefix: str | list[int] | list[dict],
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
    ) -> int:
        """Release the pin of `prefix` (as pinned: same tenant and adapter); returns the tokens it
        held, 0 when it was not pinned. Its blocks stay cached, evictable again."""
        ids = self.llm_engine.pins.token_ids(prefix, chat_template)
        return self.llm_engine.pins.unpin(ids, cache_salt, lora_request)

    def get_prefix_cache_stats(self):
        """Requests, queried tokens, hit tokens and hit rate since start."""
        return self.llm_engine.prefix_cache_stats

    # -- pooling (vLLM's LLM.embed / LLM.encode) ---------------------------------------------------
    def embed(
        self,
        prompts: Any,
        *,
        pooling_params: PoolingParams | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: the final hidden states pooled LAST (the default for decoder
        models, as vLLM), MEAN, CLS or ALL (one vector per token), L2-normalized unless
        `normalize=False`; the defaults come from the engine's `pooler_config`. With
        `enable_stage_output_cache=True` a prompt that shares cached blocks with an earlier one
        reuses their hidden states (MEAN and ALL included)."""
        params = _pooling_params(pooling_params, pooling, normalize, self.llm_engine.config.default_pooling)
        outs = self.encode(
            prompts,
            params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            truncate_prompt_tokens=truncate_prompt_tokens,
            tokenization_kwargs=tokenization_kwargs,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pooled final hidden states as tensors (`outputs.data`); `pooling_task="token_embed"`
        is ALL pooling, "embed" (or None) follows `pooling_params` (default: the engine's
        `pooler_config`)."""
        if lora_request is not None:
            raise ValueError("embed()/encode() with a LoRA adapter is not supported by prefixkv yet")
        for name, value in (
            ("truncate_prompt_tokens", truncate_prompt_tokens),
            ("tokenization_kwargs", tokenization_kwargs),
        ):
            if value is not None and value != {}:
                raise ValueError(f"encode({name}=...) is not supported by prefixkv: {_UNSUPPORTED_CALL_ARGS[name]}")
        params = pooling_params or self.llm_engine.config.default_pooling
        if pooling_task == "token_embed":
            params = PoolingParams("all", params.normalize)
        elif pooling_task not in (None, "embed"):
            raise ValueError(
                f"pooling_task={pooling_task!r} is not supported by prefixkv: only 'embed' and 'token_embed'"
            )
        items = _as_prompt_list(prompts, None)
        if any(mm is not None for _, _, mm, _ in items):
            raise ValueError("embed()/encode() of prompts with multi_modal_data is not supported by prefixkv yet")
        engine = self.llm_engine
        # one greedy token is drawn and dropped: the prompt's last position is computed like any prefill
        sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        processed = [  # every prompt checked before any runs
            engine.input_processor.process(item, sampling, cache_salt=salt, hidden_states_from=params.first_position)
            for item, salt, _, _ in items
        ]
        request_ids: list[str] = []
        try:
            for req in processed:
                request_ids.append(engine.add_processed(req))
        except BaseException:
            engine.abort_request(request_ids)
            raise
        results = []
        for out in self._run(request_ids, use_tqdm):
            if out.error is not None or out.hidden_states is None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error or 'no hidden states'}")
            data = pool(out.hidden_states, params)
            results.append(
                PoolingRequestOutput(
                    out.request_id, PoolingOutput(data), out.prompt_token_ids, True, out.num_cached_tokens
                )
            )
        return results
