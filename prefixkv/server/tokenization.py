"""POST /tokenize and /detokenize, vLLM's shapes: a prompt (or chat messages, rendered exactly as
a chat request would be) to token ids, and token ids back to text. No engine request is made."""

from __future__ import annotations

import asyncio
from typing import Any

from .chat import OpenAIServingChat
from .errors import APIError
from .protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    unsupported_fields,
)


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat  # the chat route's rendering, so /tokenize gives the tokens a chat request prefills

    @staticmethod
    def _refuse_extras(req: Any) -> None:
        refused = unsupported_fields(req.model_extra)
        if refused:
            name, why = refused[0]
            raise APIError(f"unsupported field {name!r}: {why}", 400, param=name)

    async def tokenize(self, body: dict[str, Any]) -> TokenizeResponse:
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", 400)
        req: TokenizeChatRequest | TokenizeCompletionRequest
        try:
            if "messages" in body:
                req = TokenizeChatRequest.model_validate(body)
            else:
                req = TokenizeCompletionRequest.model_validate(body)
        except ValueError as e:  # pydantic's ValidationError
            raise APIError(f"invalid request: {e}", 400) from e
        self.chat.check_model(req.model)
        self._refuse_extras(req)
        if isinstance(req, TokenizeChatRequest):
            ids, _ = await self.chat.prompt(req)  # image parts: their placeholders, as a chat request prefills
        else:
            self.chat.check_text(req.prompt, "prompt")
            ids = await self.chat.tokenize(req.prompt, req.add_special_tokens)
        tok = self.chat.tokenizer
        strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.chat.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.chat.check_model(req.model)
        self._refuse_extras(req)
        vocab = self.chat.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is out of range (vocabulary size {vocab})", 400, param="tokens")
        text = await asyncio.to_thread(self.chat.tokenizer.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)
