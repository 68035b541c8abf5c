"""The chained block hashes of an OpenAI request's prompt, as the replicas' KV events name them.

The router sees the raw JSON body. It tokenizes the prompt as the routes do (completions: the
text with special tokens unless `add_special_tokens` is false; chat: the chat template rendered
with the request's options, then encoded without special tokens), chains the full blocks from
the engine's root hash with the cache's own hash_chain() and extra_keys() (prefixkv/cache/identity.py),
then converts each digest to vLLM's ExternalBlockHash as the publisher does (prefixkv/kv_events/wire.py).

A request naming a LoRA adapter carries the adapter's block key ("lora", name, path, digest:
lora_extra_key() in prefixkv/cache/identity.py) on every block, as the engine does; the ingress
asks a replica for that key (ReplicaSet.adapter_key).

Routing only: a prompt that cannot be rendered here (images, tools the template rejects) yields
no hashes, or hashes no replica holds, and the request is routed by load alone. The replica still validates the request
and answers its 400; a wrong guess costs a cache hit, never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..cache.identity import HashFunction, extra_keys, get_hash_function, hash_chain, none_hash
from ..kv_events.wire import ExternalBlockHash, hash_converter
from ..model.tokenizer import Tokenizer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ROUTED_PATHS = (COMPLETIONS, CHAT)
# ("lora", adapter name, path, weights digest): the extra key on every block of a LoRA request
LoRABlockKey = tuple[str, str, str, str]


class PromptHasher:
    """hashes(path, body) -> the request's block hashes (first prompt only), in chain order."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        block_size: int,
        hash_algo: str = "sha256_cbor",
        hash_seed: int | None = None,
        converter: Callable[[bytes], ExternalBlockHash] | None = None,
    ) -> None:
        if hash_algo.startswith("xxhash") and hash_seed is None:
            # seeded at random in every process: the router could never reproduce a replica's hashes
            raise ValueError(
                f"prefix_caching_hash_algo {hash_algo!r} is seeded per process; the precise router needs "
                "sha256_cbor or sha256 (or use the approximate index)"
            )
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.hash_fn: HashFunction = get_hash_function(hash_algo, hash_seed)
        self.root = none_hash(self.hash_fn, 0 if hash_seed is None else hash_seed)
        self.convert = converter or hash_converter()

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids, or [] when it cannot be known here."""
        try:
            if path == COMPLETIONS:
                return self._completion_ids(body)
            if path == CHAT:
                return self._chat_ids(body)
        except Exception:  # a prompt the replica will refuse or render otherwise: route by load
            return []
        return []

    def _completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, bool(body.get("add_special_tokens", True)))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return []

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return []
        rendered = []
        for m in messages:
            if not isinstance(m, dict):
                return []
            content = m.get("content")
            if isinstance(content, list):  # text parts joined as the route joins them; images: give up
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    return []
                content = "\n".join(str(p.get("text", "")) for p in content)
            rendered.append({k: v for k, v in {**m, "content": content}.items() if v is not None})
        continue_final = bool(body.get("continue_final_message", False))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        text = self.tokenizer.apply_chat_template(
            rendered,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not continue_final,
            tokenize=False,
            chat_template=body.get("chat_template"),
            continue_final_message=continue_final,
            **kwargs,
        )
        assert isinstance(text, str)
        return self.tokenizer.encode(text, bool(body.get("add_special_tokens", False)))

    def chain(
        self, ids: Sequence[int], cache_salt: str | None = None, lora_key: LoRABlockKey | None = None
    ) -> list[ExternalBlockHash]:
        """External hashes of the full blocks the engine could look up (its rule: the last
        prompt token is always computed, so a prompt of exactly k blocks looks up k - 1)."""
        bs = self.block_size
        n = (len(ids) - 1) // bs if ids else 0
        tokens = [tuple(ids[i * bs : (i + 1) * bs]) for i in range(n)]
        extras = [extra_keys(lora_key, (), cache_salt, i * bs, (i + 1) * bs, i) for i in range(n)]
        return [self.convert(h) for h in hash_chain(self.hash_fn, self.root, tokens, extras)]

    def hashes(self, path: str, body: dict[str, Any], lora_key: LoRABlockKey | None = None) -> list[ExternalBlockHash]:
        """`lora_key`: the block key of the adapter the body's `model` names (None: the base model)."""
        salt = body.get("cache_salt")
        return self.chain(self.token_ids(path, body), salt if isinstance(salt, str) else None, lora_key)
