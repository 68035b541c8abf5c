"""Tokenizer: a thin wrapper over HF `tokenizers.Tokenizer`, built from an HF folder
(tokenizer.json + tokenizer_config.json) or from GGUF metadata (`tokenizer.ggml.*`)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from .chat_template import compile_chat_template
from .gguf_gemma4_vocab import GEMMA4_END_TEXTS, build_gemma4_tokenizer
from .gguf_sentencepiece import EOT_TEXTS, SPM_DEFAULT_IDS, build_spm_tokenizer

if TYPE_CHECKING:
    from jinja2 import Template

# llama.cpp token types (gguf.TokenType)
_TT_CONTROL = 3
_TT_USER_DEFINED = 4

# llama.cpp's splits for byte-level BPE (llm_tokenizer_bpe in its llama-vocab.cpp). Each regex of
# a list splits every piece the previous one left: its matches and the text between them both
# become pieces, which is what `Split(..., behavior="isolated")` does.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5: Qwen2's split with combining marks kept in words
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss): a word's capitals stay with its lower-case letters, contractions join the word
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GGUFPreTokenizer:
    """What a `tokenizer.ggml.pre` name means to llama.cpp: the splits before byte-level BPE,
    whether a piece found whole in the vocabulary skips the merges, and whether BOS is added when
    the file does not say (`tokenizer.ggml.add_bos_token`)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False

    def build(self) -> Any:
        if self.splits == (_DIGIT_SPLIT, _GPT2_SPLIT):
            # HF's own form of this split (SmolLM2's tokenizer.json), identical pieces
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        steps: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.splits]
        return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_DIGIT_SPLIT = r"\p{N}"
_DEFAULT = GGUFPreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2 = GGUFPreTokenizer((_GPT2_SPLIT,))
_DIGITS_THEN_GPT2 = GGUFPreTokenizer((_DIGIT_SPLIT, _GPT2_SPLIT))
_LLAMA3 = GGUFPreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_LLAMA3_SPLIT_ONLY = GGUFPreTokenizer((_LLAMA3_SPLIT,))
_QWEN2 = GGUFPreTokenizer((_QWEN2_SPLIT,))
_O200K = GGUFPreTokenizer((_O200K_SPLIT,))
_QWEN35 = GGUFPreTokenizer((_QWEN35_SPLIT,))

# The llama.cpp names implemented here. Others (deepseek-*, falcon, tekken, llama4, bloom,
# chameleon, kimi-k2, ... and names llama.cpp does not know) are refused: llama.cpp itself
# falls back to "default" for an unknown name, which tokenizes such a model wrongly.
GGUF_PRE_TOKENIZERS: dict[str, GGUFPreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum"), _GPT2
    ),
    **dict.fromkeys(("exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), _LLAMA3_SPLIT_ONLY),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"), _QWEN2),
    **dict.fromkeys(("gpt-4o", "minimax-m2"), _O200K),
    "qwen35": _QWEN35,
}


def gguf_pre_tokenizer_spec(pre: str | None) -> GGUFPreTokenizer:
    """llama.cpp's meaning of `tokenizer.ggml.pre` = `pre`; a file without the key (converted
    before llama.cpp wrote it) is "default", as llama.cpp reads it. Unknown names are refused."""
    name = "default" if pre is None else str(pre)
    spec = GGUF_PRE_TOKENIZERS.get(name)
    if spec is None:
        raise ValueError(
            f"Unsupported GGUF pre-tokenizer tokenizer.ggml.pre={name!r}: its text split is not implemented here, "
            f"and another split would give other token ids. Supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
        )
    return spec


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """HF's continue_final_message: the rendered text up to the end of the final message's content."""
    if not messages:
        raise ValueError("continue_final_message needs at least one message")
    content = messages[-1].get("content")
    if isinstance(content, list):  # text parts: the last one ends the message
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        content = texts[-1] if texts else ""
    final = (content or "").strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ValueError(
            "continue_final_message: the final message's content does not appear in the rendered chat template"
        )
    return text[: at + len(final)]


class TextStream:
    """The text of a growing token sequence, one step per new token: `tokenizers`' DecodeStream,
    one native call per token over a short window of recent tokens. A step returns the text the
    new tokens complete, or "" while they end inside a character (a UTF-8 sequence split over byte
    tokens); the pieces joined equal `decode` of the sequence up to its last complete character.

    A byte-fallback decoder turns a whole run of byte tokens into U+FFFD when the run is invalid
    UTF-8, which rewrites text already returned; DecodeStream then raises, and the stream goes on
    with the same window decoded from Python (what the final, whole decode replaces anyway).

    `context`: tokens before the sequence (the prompt's last few), decoded for context only, as
    vLLM's detokenizer does: a decoder that drops the first token's leading space (SentencePiece's
    Metaspace, "first") drops it only at the start of the prompt, so "▁Paris" after a prompt reads
    " Paris" (`Tokenizer.decode_after` gives the whole text the same way)."""

    __slots__ = ("_backend", "_skip", "_stream", "_seen", "_window", "_context")

    def __init__(self, backend: HFTokenizer, skip_special_tokens: bool, context: Sequence[int] = ()) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._context = list(context)
        self._stream: DecodeStream | None = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._seen = 0  # tokens of the sequence stepped so far
        # tokens of context + sequence [start, read): decoded for context, [read, ...): not yet returned
        self._window = (0, len(self._context))

    def step(self, ids: Sequence[int]) -> str:
        """The text completed by the tokens `ids` (the whole sequence so far) gained since the last step."""
        start, self._seen = self._seen, len(ids)
        if self._seen <= start:
            return ""
        if self._stream is not None:
            try:
                if self._seen - start == 1:
                    piece = self._stream.step(self._backend, ids[-1]) or ""
                else:  # several at once: token by token (older tokenizers take no list)
                    piece = "".join(self._stream.step(self._backend, t) or "" for t in ids[start:])
            except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception for the rewritten prefix)
                self._stream = None
            else:
                if piece:
                    self._window = (self._window[1], self._seen)
                return piece
        first, read = self._window
        seq = self._context + list(ids)
        before = self._backend.decode(seq[first:read], skip_special_tokens=self._skip)
        text = self._backend.decode(seq[first:], skip_special_tokens=self._skip)
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._window = (read, len(seq))
            return text[len(before) :]
        return ""


def _gguf_special_id(meta: dict[str, Any], key: str, num_tokens: int, default: int | None = None) -> int | None:
    """`tokenizer.ggml.{key}_token_id` of GGUF metadata (`default` where absent), None where it is
    no token of the vocabulary."""
    value = meta.get(f"tokenizer.ggml.{key}_token_id", default)
    return None if value is None or not 0 <= int(value) < num_tokens else int(value)


class Tokenizer:
    """Text <-> token ids, chat template rendering and streaming detokenization."""

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        pad_token_id: int | None = None,
    ) -> None:
        self._tok = hf_tokenizer
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        eos = [int(x) for x in eos_token_ids]
        self.eos_token_id: int | None = eos[0] if eos else None
        self.eos_token_ids: set[int] = set(eos)
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self._template: Template | None = None

    # ------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return None if self.pad_token_id is None else self._tok.id_to_token(self.pad_token_id)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def reading_context(self, prompt_ids: Sequence[int], skip_special_tokens: bool = True, n: int = 5) -> list[int]:
        """The prompt's last tokens (at most `n`) that a generated sequence's text is read after:
        from the first of them whose text is whole (a context that starts inside a character split
        over byte tokens would decode to U+FFFD and shift what follows); [] when none is."""
        tail = list(prompt_ids[-n:]) if n > 0 else []
        for k in range(len(tail)):
            if "\ufffd" not in self._tok.decode(tail[k:], skip_special_tokens=skip_special_tokens):
                return tail[k:]
        return []

    def decode_after(self, context: Sequence[int], ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` as it reads after the tokens `context` (a generated sequence after its
        prompt, see TextStream); `decode(ids)` where the context's text is not a prefix of the whole."""
        if not context:
            return self.decode(ids, skip_special_tokens)
        before = self._tok.decode(list(context), skip_special_tokens=skip_special_tokens)
        text = self._tok.decode([*context, *ids], skip_special_tokens=skip_special_tokens)
        return text[len(before) :] if text.startswith(before) else self.decode(ids, skip_special_tokens)

    # ------------------------------------------------------- streaming
    def decode_stream(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> TextStream:
        """A stream that turns generated tokens into text as they arrive, read after the tokens
        `context` (see TextStream)."""
        return TextStream(self._tok, skip_special_tokens, context)

    # ---------------------------------------------------- chat template
    def set_chat_template(self, template: str | None) -> None:
        """Replace the model's chat template (`--chat-template`)."""
        self.chat_template = template
        self._template = None

    def _compiled_template(self, template: str | None = None):
        """The model's template (compiled once), or `template` (a per-request one, compiled and
        kept in a small cache: clients resend the same few)."""
        if template is not None:
            return compile_chat_template(template)
        if self._template is None:
            if not self.chat_template:
                raise ValueError("This tokenizer has no chat template")
            self._template = compile_chat_template(self.chat_template)
        return self._template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` (HF's semantics). `chat_template`: a Jinja template to use instead of
        the model's; `continue_final_message`: end the text right after the last message's
        content (no end-of-turn), so the model continues it, as HF and vLLM do."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        text = self._compiled_template(chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    # ---------------------------------------------------- constructors
    @classmethod
    def from_hf_folder(cls, folder: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No tokenizer.json in model folder {folder!r}")
        tok = HFTokenizer.from_file(path)
        cfg: dict[str, Any] = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        def tid(name: str) -> int | None:
            content = _token_content(cfg.get(name))
            return None if content is None else tok.token_to_id(content)

        bos = tid("bos_token")
        eos_ids = [x for x in [tid("eos_token")] if x is not None]
        gen_path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                g = json.load(f).get("eos_token_id")
            eos_ids += [g] if isinstance(g, int) else list(g or [])
        for x in extra_eos_ids:
            eos_ids.append(int(x))
        eos_ids = list(dict.fromkeys(eos_ids))
        # tokenizer.json may carry a post-processor that adds BOS; we add specials ourselves.
        add_bos = bool(cfg.get("add_bos_token", False))
        if tok.post_processor is not None and bos is not None:
            probe = tok.encode("a", add_special_tokens=True).ids
            add_bos = add_bos or (len(probe) > 0 and probe[0] == bos)
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=template,
            add_bos_token=add_bos,
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            pad_token_id=tid("pad_token"),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        model_type = meta.get("tokenizer.ggml.model")
        if model_type == "llama":
            return cls._from_gguf_sentencepiece(meta)
        if model_type == "gemma4":
            return cls._from_gguf_gemma4(meta)
        if model_type != "gpt2":
            raise ValueError(
                f"Unsupported GGUF tokenizer model tokenizer.ggml.model={model_type!r}: its tokenization is not "
                "implemented here. Supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece), 'gemma4'"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())

        def spell(t: str) -> str:
            return t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))

        vocab = {spell(t): i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre = gguf_pre_tokenizer_spec(meta.get("tokenizer.ggml.pre"))
        tok = HFTokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
        )
        tok.pre_tokenizer = pre.build()
        tok.decoder = decoders.ByteLevel()
        control = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, token_types)
            if ty == _TT_CONTROL and set(t) <= alphabet
        ]
        if control:
            tok.add_special_tokens(control)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, token_types)
            if ty == _TT_USER_DEFINED and spell(t) in vocab
        ]
        if user:
            tok.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [] if eos is None else [int(eos)]
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.append(int(eot))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        pad = meta.get("tokenizer.ggml.padding_token_id")
        return cls(
            tok,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            pad_token_id=None if pad is None else int(pad),
        )

    @classmethod
    def _from_gguf_gemma4(cls, meta: dict[str, Any]) -> Tokenizer:
        """Gemma 4's vocabulary (gguf_gemma4_vocab.py); BOS always added and the tokens llama.cpp
        ends generation at (<eos>, <turn|>, <|tool_response>) beside the file's EOS."""
        tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        eos, eot = _gguf_special_id(meta, "eos", len(tokens)), _gguf_special_id(meta, "eot", len(tokens))
        ends = [eos, eot, *(i for i, t in enumerate(tokens) if t in GEMMA4_END_TEXTS)]
        return cls(
            build_gemma4_tokenizer(meta),
            bos_token_id=_gguf_special_id(meta, "bos", len(tokens)),
            eos_token_ids=list(dict.fromkeys(x for x in ends if x is not None)),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=True,
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            pad_token_id=_gguf_special_id(meta, "padding", len(tokens)),
        )

    @classmethod
    def _from_gguf_sentencepiece(cls, meta: dict[str, Any]) -> Tokenizer:
        """A SentencePiece vocabulary; special ids and BOS/EOS as llama.cpp reads them: BOS 1 and
        EOS 2 where the file names none, BOS added unless the file says not, and a token llama.cpp
        recognizes by its text (Gemma's <end_of_turn>) ends generation where no eot_token_id is given."""
        tok = build_spm_tokenizer(meta)
        tokens = list(meta["tokenizer.ggml.tokens"])
        n = len(tokens)
        eos = _gguf_special_id(meta, "eos", n, SPM_DEFAULT_IDS["eos"])
        eot = _gguf_special_id(meta, "eot", n)
        if eot is None:
            eot = next((i for i, t in enumerate(tokens) if t in EOT_TEXTS), None)
        eos_ids = [x for x in (eos, eot) if x is not None]
        return cls(
            tok,
            bos_token_id=_gguf_special_id(meta, "bos", n, SPM_DEFAULT_IDS["bos"]),
            eos_token_ids=list(dict.fromkeys(eos_ids)),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            pad_token_id=_gguf_special_id(meta, "padding", n),
        )
