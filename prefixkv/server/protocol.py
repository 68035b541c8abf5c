"""OpenAI-compatible request and response models, with vLLM's extra sampling fields.

Fields prefixkv does not implement are refused by name (400), as OpenAI refuses an unrecognized
argument: a request never gets a 200 that silently behaves differently from what it asked
(`unsupported_fields`)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..constraints.validation import normalize_logit_bias
from ..sampling_params import SamplingParams
from .structured import ResponseFormat, structured_outputs_of
from .tools import ChatTool, DeltaToolCall, NamedToolChoice, ToolCall


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


# Known OpenAI / vLLM request fields that prefixkv does not implement yet, with what to do instead.
UNSUPPORTED_FIELDS = {
    "guided_json": 'vLLM 0.32 dropped guided_*: use structured_outputs {"json": ...} or response_format',
    "guided_regex": 'vLLM 0.32 dropped guided_*: use structured_outputs {"regex": ...}',
    "guided_choice": 'vLLM 0.32 dropped guided_*: use structured_outputs {"choice": [...]}',
    "guided_grammar": 'vLLM 0.32 dropped guided_*: use structured_outputs {"grammar": ...}',
    "guided_decoding_backend": "one structured-outputs backend (xgrammar): nothing to choose",
    "tools": "tool calling is on /v1/chat/completions",
    "tool_choice": "tool calling is on /v1/chat/completions",
    "parallel_tool_calls": "tool calling is on /v1/chat/completions",
    "functions": "function calling is not implemented yet",
    "function_call": "function calling is not implemented yet",
    "prompt_embeds": "prompt embeddings are not supported",
    "lora_request": 'select a LoRA adapter with "model": its name (--lora-modules / /v1/load_lora_adapter)',
    "mm_processor_kwargs": "the checkpoint's own image processor settings are used",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "verbosity": "no chat template of a model served here reads it; one that does takes it as "
    'chat_template_kwargs {"verbosity": ...}',
    "tool_call_id": "tool calling is not implemented yet",
}


# OpenAI fields whose effect does not apply to a local engine: accepted (type-checked), logged
# once per process (server/serving.py), never refused - the SDK and agent frameworks send them.
NO_EFFECT_FIELDS: dict[str, tuple[type, str]] = {
    "store": (bool, "OpenAI's stored completions: nothing is stored here"),
    "metadata": (dict, "OpenAI's stored-completion tags: nothing is stored here"),
    "service_tier": (str, "one processing tier here"),
    "safety_identifier": (str, "no usage-policy monitoring here"),
    "prompt_cache_key": (
        str,
        "prefix caching is automatic and exact on one engine; with --replicas it is the routing key (docs/replicas.md)",
    ),
    # vLLM's: read only by its /render endpoints; "ignored on regular generation endpoints" there too
    "return_token_offsets": (bool, "vLLM reads it only on its /render endpoints, which generate nothing"),
}


def unsupported_fields(extra: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(field, why) for every field of a request body that prefixkv does not implement. A field
    sent as null is the same as not sent (clients often send their defaults as null)."""
    out = []
    for name, value in (extra or {}).items():
        if value is None or name in NO_EFFECT_FIELDS:
            continue
        out.append((name, UNSUPPORTED_FIELDS.get(name, "unrecognized request argument")))
    return out


def no_effect_fields(extra: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(field, why it changes nothing) for the NO_EFFECT_FIELDS a body sends; ValueError naming a
    field of the wrong type (OpenAI refuses those too)."""
    out = []
    for name, value in (extra or {}).items():
        if value is None or name not in NO_EFFECT_FIELDS:
            continue
        kind, why = NO_EFFECT_FIELDS[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{name} must be a {'JSON object' if kind is dict else kind.__name__}")
        if isinstance(value, dict) and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"{name} must map strings to strings")
        out.append((name, why))
    return out


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Undeclared fields are kept in
    `model_extra` so that the route can refuse them by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    # prefixkv's cache control (docs/serving.md): this request's blocks' eviction priority under
    # --eviction-policy priority, and pinning its prompt once it has run
    cache_priority: int | None = None
    pin: bool = False
    request_id: str | None = None
    prompt_logprobs: int | None = None  # vLLM extra: top-k logprobs at every prompt position
    priority: int = 0  # vLLM extra: with --scheduling-policy priority, lower is scheduled first
    truncate_prompt_tokens: int | None = None  # vLLM extra: keep the prompt's last k tokens (-1: the context)
    truncation_side: Literal["left", "right"] | None = None  # vLLM extra: "right" keeps the first k instead
    return_token_ids: bool | None = None  # vLLM extra: prompt_token_ids and each choice's token_ids
    # vLLM extra: logprobs name each token `token_id:N` (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a string key) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM extra
    bad_words: list[str] | None = None  # vLLM extra
    response_format: ResponseFormat | None = None  # OpenAI's: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM extra: StructuredOutputsParams' fields
    # vLLM extra: with --reasoning-parser, reasoning tokens at most (-1: no limit); "3" is no integer
    thinking_token_budget: int | None = Field(default=None, strict=True)
    # vLLM extra: end the output when its tail repeats a pattern (max_pattern_size, min_pattern_size, min_count)
    repetition_detection: dict[str, Any] | None = None
    # vLLM extra: a stream's chunks gather this many tokens (at least the server's --stream-interval)
    stream_interval: int | None = Field(default=None, strict=True)
    # vLLM extras: beam search with n beams (server/beam_search.py); early_stopping only False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Raises ValueError (-> HTTP 400) on bad values. `defaults`: the model's sampling
        defaults (generation_config.json) for the fields the request leaves out, as vLLM."""
        d = defaults or {}
        return SamplingParams(
            n=self.n,
            temperature=d.get("temperature", 1.0) if self.temperature is None else self.temperature,
            top_p=d.get("top_p", 1.0) if self.top_p is None else self.top_p,
            top_k=d.get("top_k", 0) if self.top_k is None else self.top_k,
            min_p=d.get("min_p", 0.0) if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=d.get("repetition_penalty", 1.0)
            if self.repetition_penalty is None
            else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=normalize_logit_bias(self.logit_bias),  # JSON keys are strings: token ids here
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=structured_outputs_of(self.response_format, self.structured_outputs),
            thinking_token_budget=self.thinking_token_budget,
            stream_interval=self.stream_interval,
            repetition_detection=self.repetition_detection,  # type: ignore[arg-type]  # a dict, checked there
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # prefixkv extra (for a downstream stage): each choice carries the final hidden state of every
    # computed position, prompt then output but its last token (SamplingParams.return_hidden_states)
    return_hidden_states: bool | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echoed prompt tokens get logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self._params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM extra: the reply starts with the last message's text when that message has the reply's role
    echo: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's, for reasoning models: handed to the chat template as `reasoning_effort` (as vLLM
    # does); a template that does not read it renders as without it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's, for retrieval-augmented templates (Command R, Granite): handed to the chat template as
    # `documents`; a template that does not read them renders as without them
    documents: list[dict[str, str]] | None = None
    # vLLM's: with --reasoning-parser, false leaves the reasoning out of the reply (and with it the
    # logprobs and token ids, which would show it); without a parser there is none to leave out
    include_reasoning: bool = True

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, lp, None, defaults)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages (vLLM's shape): the tokens a chat request would prefill."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    pinned_tokens: int | None = None  # prefixkv's `pin`: the prompt tokens now pinned (None: not asked)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # with --reasoning-parser: the output tokens before the reasoning's end


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # built from prefixkv.outputs.Logprob

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # vLLM's: None, then one entry a position


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: first chunk of the choice)
    token_ids: list[int] | None = None  # return_token_ids (streamed: this chunk's tokens)
    hidden_states: HiddenStates | None = None  # return_hidden_states


class HiddenStates(BaseModel):
    """A (rows, hidden_size) float32 tensor: base64 of its row-major little-endian bytes."""

    shape: list[int]
    dtype: Literal["float32"] = "float32"
    data: str


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM's, with --reasoning-parser


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # vLLM's, with --reasoning-parser


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first (role) chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "prefixkv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, as vLLM."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, as vLLM (lora_int_id is accepted and not needed)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's shape; vLLM's `normalize`, `add_special_tokens`, `cache_salt`
    and `request_id` extras). Undeclared fields are refused by name, as for the other routes."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    normalize: bool | None = None  # None: the server's --pooler-config (normalized by default)
    add_special_tokens: bool = True
    cache_salt: str | None = None
    request_id: str | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's POST /pooling: an embeddings request with a `task` ("embed", "token_embed")."""

    task: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | list[list[float]] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo  # as vLLM: completion_tokens stays 0


class PoolingResponse(EmbeddingResponse):
    data: list[PoolingData]  # type: ignore[assignment]
