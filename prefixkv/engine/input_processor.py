"""Admission: a prompt (text or token ids) with its sampling params, LoRA adapter, images, salt and
priority becomes a validated, frozen `EngineRequest` once - tokenized, truncated, its images
expanded, its grammar compiled - before the engine registers anything.

Nothing here touches engine state, so the server runs it outside the engine loop, which only
resolves the LoRA adapter (the engine's adapter registry) and registers the result.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..constraints.grammar import GrammarEngine, GrammarGate, choose_backend
from ..constraints.token_constraints import ThinkingBudget
from ..constraints.validation import check_vocab
from ..engine_args import EngineArgs
from ..lora.request import LoRARequest
from ..model import ModelConfig
from ..model.tokenizer import Tokenizer
from ..reasoning import REASONING_PARSERS, ReasoningParser
from ..request import MultiModalItem
from ..sampling_params import SamplingParams, truncate_prompt_tokens

if TYPE_CHECKING:
    from ..multimodal import MultiModalInputProcessor


@dataclass(frozen=True)
class EngineRequest:
    """One admitted prompt, ready for the engine to turn into its n sequences."""

    prompt: str | None  # the text the ids came from, when known
    prompt_token_ids: tuple[int, ...]  # tokenized, truncated, image tokens expanded
    params: SamplingParams
    lora_request: LoRARequest | None  # as asked: the engine resolves it when it registers the request
    cache_salt: str | None
    priority: int
    mm_items: tuple[MultiModalItem, ...]
    hidden_states_from: int | None  # the prompt position whose final hidden states are returned on
    grammar: Any  # the compiled grammar of params.structured_outputs, or None
    cache_priority: int | None = None  # eviction order of its blocks, when not its priority's
    grammar_gate: GrammarGate | None = None  # the grammar starts after the reasoning (reasoning_parser)
    thinking_budget: ThinkingBudget | None = None  # params.thinking_token_budget, where the output thinks


class InputProcessor:
    def __init__(
        self,
        config: EngineArgs,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        max_model_len: int,
        mm_processor: MultiModalInputProcessor | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.mm_processor = mm_processor
        # the prompt's image token as text ("<image>"), and how many images a prompt may hold;
        # None: a text-only model
        self.image_token: str | None = None
        self.max_images: int | None = None
        if mm_processor is not None:
            self.image_token = tokenizer.id_to_token(mm_processor.mm.image_token_id)
            self.max_images = mm_processor.max_images
        self.eos_ids = set(tokenizer.eos_token_ids)
        choose_backend(config.structured_outputs_backend)  # refused at start: unknown, or xgrammar missing
        self._grammar_engine: GrammarEngine | None = None  # built on the first structured request
        self._grammar_lock = threading.Lock()
        self.reasoning: ReasoningParser | None = None
        if config.reasoning_parser is not None:
            if config.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(
                    f"unknown reasoning_parser {config.reasoning_parser!r}; choose one of {sorted(REASONING_PARSERS)}"
                )
            self.reasoning = REASONING_PARSERS[config.reasoning_parser](tokenizer)

    def process(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        multi_modal_data: Any = None,
        hidden_states_from: int | None = None,
    ) -> EngineRequest:
        """A prompt (text, or token ids that `prompt_text` came from) tokenized, truncated and its
        images expanded, then admitted. ValueError naming what is wrong with any part."""
        params = params if params is not None else SamplingParams()
        self.validate_params(params)
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = prompt_text, list(prompt)
        ids = truncate_prompt_tokens(ids, params.truncate_prompt_tokens, self.max_model_len)
        ids, mm_items = self.process_multimodal(ids, multi_modal_data)
        return self._request(ids, params, text, lora_request, cache_salt, priority, mm_items, hidden_states_from)

    def admit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt_text: str | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        mm_items: Sequence[MultiModalItem] = (),
        hidden_states_from: int | None = None,
        cache_priority: int | None = None,
        thinks: bool | None = None,
    ) -> EngineRequest:
        """Token ids already truncated, their images already expanded (`process_multimodal`, so
        the caller knows the prompt's length first), admitted. ValueError as `process`.
        `thinks`: whether the output starts in reasoning, as the caller decided it with this
        engine's reasoning parser (None: read from the prompt)."""
        self.validate_params(params)
        if mm_items and self.mm_processor is None:
            raise ValueError("multimodal items were given but this model is text-only: it takes no images")
        items = tuple(mm_items)
        if items:
            ids = list(prompt_token_ids)
        else:  # no images: a prompt that names one is refused
            ids, items = self.process_multimodal(prompt_token_ids, None)
        req = self._request(
            ids, params, prompt_text, lora_request, cache_salt, priority, items, hidden_states_from, thinks
        )
        if cache_priority is not None:
            self.check_cache_priority(cache_priority)
            req = replace(req, cache_priority=cache_priority)
        return req

    def _request(
        self,
        ids: list[int],
        params: SamplingParams,
        text: str | None,
        lora_request: LoRARequest | None,
        cache_salt: str | None,
        priority: int,
        mm_items: tuple[MultiModalItem, ...],
        hidden_states_from: int | None,
        thinks: bool | None = None,
    ) -> EngineRequest:
        self.check_priority(priority)
        grammar = self.compile_grammar(params)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")  # noqa: TRY004
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        self.validate_prompt(ids)
        if params.return_hidden_states and hidden_states_from is None:
            hidden_states_from = 0  # every position, the prompt's first on
        if hidden_states_from is not None:
            if not isinstance(hidden_states_from, int) or not -len(ids) <= hidden_states_from < len(ids):
                raise ValueError(f"hidden_states_from={hidden_states_from!r} is not a position of the prompt")
            hidden_states_from %= len(ids)
        gate = budget = None
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError(
                "thinking_token_budget needs a reasoning parser (--reasoning-parser / reasoning_parser=): "
                "it says which tokens are reasoning and which token ends it"
            )
        if self.reasoning is not None and (grammar is not None or params.thinking_token_budget is not None):
            if self.reasoning.thinks(ids) if thinks is None else thinks:
                gate = self.reasoning.grammar_gate() if grammar is not None else None
                if params.thinking_token_budget is not None:
                    budget = self.reasoning.thinking_budget(params.thinking_token_budget)
            elif params.thinking_token_budget is None:
                gate = self.reasoning.grammar_gate(thinking=False)  # a model that opens its reasoning itself
            elif self.reasoning.opens_in_reply:
                raise ValueError(
                    f"thinking_token_budget with --reasoning-parser {self.reasoning.name}: the model opens its "
                    f"reasoning ({self.reasoning.start}) itself, and the budget is counted only where the prompt "
                    "opened it"
                )
        return EngineRequest(
            text,
            tuple(ids),
            params,
            lora_request,
            cache_salt,
            priority,
            mm_items,
            hidden_states_from,
            grammar,
            grammar_gate=gate,
            thinking_budget=budget,
        )

    def check_cache_priority(self, cache_priority: int) -> None:
        """A request's own eviction priority (prefixkv's `cache_priority`): read by the priority
        eviction policy only, refused with any other."""
        if isinstance(cache_priority, bool) or not isinstance(cache_priority, int):
            raise ValueError(f"cache_priority must be an integer, got {cache_priority!r}")
        if self.config.eviction_policy != "priority":
            raise ValueError(
                f"cache_priority orders eviction only with eviction_policy='priority' (--eviction-policy priority); "
                f"this engine evicts by {self.config.eviction_policy!r}"
            )

    def check_priority(self, priority: int) -> None:
        """vLLM's request `priority` (lower: more important) orders the waiting queue with the
        priority scheduling policy and the eviction of a request's cached blocks with the priority
        eviction policy; with neither it would change nothing, so it is refused."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority" and self.config.eviction_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but neither priority scheduling nor priority eviction is enabled "
                "(scheduling_policy='priority' / --scheduling-policy priority, or eviction_policy='priority' / "
                "--eviction-policy priority)"
            )

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def process_multimodal(
        self, prompt_token_ids: Sequence[int], multi_modal_data: Any
    ) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Expand a prompt's image tokens and build its items. ValueError for images on a
        text-only model, a count of image tokens that differs from the count of images, too many
        images, or an image that cannot be decoded."""
        if self.mm_processor is None:
            if multi_modal_data:
                raise ValueError(
                    "multi_modal_data was given but this model is text-only: it takes no images "
                    "(serve a LLaVA-style checkpoint for image inputs)"
                )
            return list(prompt_token_ids), ()
        ids, items = self.mm_processor(prompt_token_ids, multi_modal_data)
        return ids, items

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                f"(max_model_len) is {self.max_model_len} tokens, which must also hold "
                "at least one generated token"
            )

    def validate_params(self, params: SamplingParams) -> None:
        """What depends on this engine, beyond SamplingParams' own checks (run again here: the
        dataclass is mutable)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")  # noqa: TRY004
        params.verify()
        limit = min(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}={value} is more than this engine allows (max_logprobs={limit})")
        check_vocab(params, self.vocab_size)
        if params.structured_outputs is not None and params.min_tokens:
            raise ValueError(
                "min_tokens cannot be combined with structured_outputs: the grammar decides where the output ends"
            )

    @property
    def grammar_engine(self) -> GrammarEngine:
        """The structured-outputs grammar engine (built once, on first use: ~0.1 s)."""
        with self._grammar_lock:
            if self._grammar_engine is None:
                self._grammar_engine = GrammarEngine(
                    self.tokenizer, self.vocab_size, sorted(self.eos_ids), self.config.structured_outputs_backend
                )
            return self._grammar_engine

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params.structured_outputs` (None without one), cached by spec.
        Thread-safe, so a step never waits for a compilation. ValueError for an invalid spec."""
        if params.structured_outputs is None:
            return None
        params.structured_outputs.verify()
        return self.grammar_engine.compile(params.structured_outputs)
