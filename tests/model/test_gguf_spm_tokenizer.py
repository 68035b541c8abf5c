"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model` "llama"): tiny SentencePiece models are
trained with byte fallback, their vocabulary written into GGUF metadata as llama.cpp's
convert_hf_to_gguf.py writes it (`_create_vocab_sentencepiece`: pieces, scores, token types, and
the tokenizer config's added tokens as control or user-defined, score -1000, user-defined spaces
spelled as spaces), and prefixkv's ids must equal the `sentencepiece` library's (BPE) and a port of
llama.cpp's llm_tokenizer_spm (BPE and unigram, which llama.cpp merges by score alike) on many
texts; decoding round-trips. A whole Gemma 2 GGUF with such a vocabulary generates through LLM."""

from __future__ import annotations

import functools
import heapq
import io
import random
from pathlib import Path

import pytest
import torch

from prefixkv.model.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")

LINES = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Prefix caching keeps the KV blocks of a shared prompt, so the next request skips them.",
    "def main(args):\n    return sum(x * x for x in args)  # squares",
    "Café, naïve, résumé, façade: accents appear in French and in English loanwords.",
    "東京は日本の首都です。京都は古い都です。日本語の文章も少しあります。",
    "Numbers 12345 and 678, dates 2024-05-17, prices $9.99 and 100%.",
    "Hello world! hello World? HELLO, world... spaces  two   three    four.",
    "Über straße Ålesund smörgåsbord crème brûlée piñata jalapeño.",
]
# English prose, markdown and code to learn merges from: the project's own docs
CORPUS = "\n".join(LINES * 4) + "\n" + (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces and trailing  ",
    "many     spaces\tand\ttabs",
    "line one\nline two\n\nline four\r\n",
    "Café crème brûlée, naïve résumé",
    "東京と京都、日本語",
    "emoji 🦊🐕 and 👩‍💻 fall back to bytes",
    "rare ǅ ʘ ꙮ characters",
    "def f(x):\n    return x ** 2",
    "",
    " ",
    "a",
    "<s>",
    "</s>",
    "<unk>",
    "text with <s> inside and </s> after",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<end_of_turn><end_of_turn>  <start_of_turn>",
    "[INST] What is the prefix cache? [/INST] It keeps blocks.",
    "call <tool>search</tool> then <tool><tool> twice",
    "Hello world  and   three",
]


# added tokens of the tokenizer config (trained as user-defined pieces); the special ones (CONTROL) the
# converter marks control, the rest user-defined
GEMMA_ADDED = ["<start_of_turn>", "<end_of_turn>", "\u2581\u2581", "\u2581\u2581\u2581"]
LLAMA_ADDED = ["[INST]", "[/INST]", "<tool>"]
CONTROL = {"<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]"}


@functools.cache  # trained once per kind for the whole file
def train(model_type: str, gemma: bool) -> spm.SentencePieceProcessor:
    """A SentencePiece model as Llama 2 (bos 1, eos 2, unk 0, space prefix) or Gemma (pad 0, eos 1,
    bos 2, unk 3, no space prefix, chat markers and whitespace runs as user-defined pieces) has it."""
    out = io.BytesIO()
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3) if gemma else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split("\n")),
        model_writer=out,
        model_type=model_type,
        vocab_size=1000,
        byte_fallback=True,
        character_coverage=0.98,  # some seen characters left to byte fallback too
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=not gemma,
        split_digits=True,
        user_defined_symbols=GEMMA_ADDED if gemma else LLAMA_ADDED,
        minloglevel=2,
        **ids,
    )
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def gguf_meta(sp: spm.SentencePieceProcessor, gemma: bool) -> dict:
    """The converter's tokenizer metadata. The tokenizer config lists the chat markers as special
    (control) and the rest (Gemma's whitespace runs, a tool tag) as plain added tokens
    (user-defined, U+2581 written as spaces)."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(
            2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else 6 if sp.is_byte(i) else 1
        )
    for i, t in enumerate(tokens):
        if t in CONTROL:
            types[i], scores[i] = 3, -1000.0
        elif t in GEMMA_ADDED + LLAMA_ADDED:
            types[i], scores[i], tokens[i] = 4, -1000.0, t.replace("\u2581", " ")
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    if sp.pad_id() >= 0:
        meta["tokenizer.ggml.padding_token_id"] = sp.pad_id()
    if gemma:
        meta["tokenizer.ggml.add_space_prefix"] = False
    return meta


def specials(meta: dict) -> list[str]:
    """The texts llama.cpp cuts out before tokenizing (control, user-defined, unknown), longest first."""
    kinds = zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
    return sorted((t for t, ty in kinds if ty in (2, 3, 4)), key=len, reverse=True)


def partition(text: str, meta: dict) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition: each special text, longest first, cut out of what raw
    text is left, left to right."""
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    parts: list[str | int] = [text] if text else []
    for special in specials(meta):
        cut: list[str | int] = []
        for part in parts:
            while isinstance(part, str) and special in part:
                before, _, part = part.partition(special)
                cut += [before] if before else []
                cut.append(ids[special])
            if part != "":
                cut.append(part)
        parts = cut
    return parts


def llama_cpp_spm(meta: dict, fragment: str) -> list[int]:
    """llama.cpp's llm_tokenizer_spm_session::tokenize on one escaped fragment: merge the adjacent
    pair whose text is the best-scoring token (leftmost on ties) until none is; what is no token
    goes out as <0xXX> byte tokens."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    sym = list(fragment)
    nxt = list(range(1, len(sym))) + [-1]
    prv = list(range(-1, len(sym) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def bigram(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and sym[left] + sym[right] in vocab:
            text = sym[left] + sym[right]
            heapq.heappush(queue, (-scores[vocab[text]], left, right, len(text)))

    for i in range(1, len(sym)):
        bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left], sym[right] = sym[left] + sym[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])
    out, i = [], 0 if sym else -1
    while i >= 0:
        if sym[i] in vocab:
            out.append(vocab[sym[i]])
        else:
            out += [vocab[f"<0x{b:02X}>"] for b in sym[i].encode()]
        i = nxt[i]
    return out


def llama_cpp_encode(meta: dict, text: str) -> list[int]:
    """llama.cpp's SPM tokenize: a space in front of each raw fragment at the start or after a
    special token (when add_space_prefix), spaces escaped to U+2581."""
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    out: list[int] = []
    prev_special = True
    for part in partition(text, meta):
        if isinstance(part, int):
            out.append(part)
            prev_special = True
            continue
        out += llama_cpp_spm(meta, ((" " if prefix and prev_special else "") + part).replace(" ", "\u2581"))
        prev_special = False
    return out


def sentencepiece_encode(sp: spm.SentencePieceProcessor, meta: dict, text: str) -> list[int]:
    """sentencepiece's ids, each raw fragment between llama.cpp's special texts encoded by itself
    (sentencepiece would spell a control token's text out; its dummy prefix goes on each fragment,
    llama.cpp's rule)."""
    out: list[int] = []
    for part in partition(text, meta):
        out += [part] if isinstance(part, int) else sp.encode(part)
    return out


@pytest.fixture(scope="module", params=[("bpe", False), ("bpe", True), ("unigram", False), ("unigram", True)])
def case(request):
    model_type, gemma = request.param
    sp = train(model_type, gemma)
    meta = gguf_meta(sp, gemma)
    return model_type, gemma, sp, meta, Tokenizer.from_gguf_metadata(meta)


def corpus_texts() -> list[str]:
    lines = LINES
    return TEXTS + lines + [" ".join(lines), "\n".join(lines)]


def test_encode_equals_llama_cpp_and_sentencepiece(case):
    model_type, gemma, sp, meta, tok = case
    for text in corpus_texts():
        got = tok.encode(text)
        assert got == llama_cpp_encode(meta, text), (text, [tok.id_to_token(i) for i in got])
        if model_type == "bpe":  # a unigram model's own Viterbi search is not what llama.cpp runs
            assert got == sentencepiece_encode(sp, meta, text), text


def test_random_texts_equal_llama_cpp(case):
    """Random mixes of words, space and newline runs, accents, CJK, emoji, broken and whole
    special-token texts."""
    _, _, _, meta, tok = case
    rng = random.Random(7)
    words = " ".join(LINES).split(" ") + specials(meta) + ["<", "start_", "[/", "INST", "tool>"]
    atoms = words + [" ", "  ", "   ", "\n", "\t", "é", "東", "🦊", "\u200b", "ǅ"]
    for _ in range(300):
        text = "".join(rng.choice(atoms) + rng.choice(["", " "]) for _ in range(rng.randrange(1, 12)))
        assert tok.encode(text) == llama_cpp_encode(meta, text), text


def test_decode_round_trips(case):
    _, gemma, sp, meta, tok = case
    for text in corpus_texts():
        if any(s in text for s in specials(meta)):
            continue
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if text:
            assert sp.decode(ids) == text  # the oracle agrees on what these ids say
        stream = tok.decode_stream()
        assert "".join(stream.step(ids[: n + 1]) for n in range(len(ids))) == text


def test_special_ids_and_bos(case):
    _, gemma, sp, meta, tok = case
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.bos_id(), sp.eos_id())
    assert tok.add_bos_token and not tok.add_eos_token
    assert tok.encode("Hello", add_special_tokens=True)[0] == sp.bos_id()
    assert tok.vocab_size == sp.get_piece_size()
    if gemma:  # <end_of_turn> ends a turn, as llama.cpp finds it by its text
        assert tok.eos_token_ids == {sp.eos_id(), sp.piece_to_id("<end_of_turn>")}
        assert tok.pad_token_id == 0
        assert tok.decode(tok.encode("<start_of_turn>user"), skip_special_tokens=True) == "user"
    else:
        assert tok.eos_token_ids == {sp.eos_id()}


def test_equal_scores_are_logged(caplog):
    """Tokens of one score merge in id order where llama.cpp takes the leftmost pair: said in the log."""
    meta = gguf_meta(train("bpe", gemma=False), gemma=False)
    with caplog.at_level("WARNING", logger="prefixkv"):
        Tokenizer.from_gguf_metadata(meta)
    assert "share a score" not in caplog.text  # a trained model's pieces all score differently
    meta["tokenizer.ggml.scores"] = [round(s / 100) for s in meta["tokenizer.ggml.scores"]]
    with caplog.at_level("WARNING", logger="prefixkv"):
        Tokenizer.from_gguf_metadata(meta)
    assert "share a score" in caplog.text


def test_llama_cpp_defaults_where_the_file_says_nothing():
    sp = train("bpe", gemma=False)
    meta = gguf_meta(sp, gemma=False)
    for key in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        del meta[f"tokenizer.ggml.{key}"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.add_eos_token) == (1, 2, True, False)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model='bert'"),
        ({"tokenizer.ggml.model": "t5"}, "tokenizer.ggml.model='t5'"),
        ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model='rwkv'"),
        ({"tokenizer.ggml.precompiled_charsmap": b"\x01\x02"}, "precompiled_charsmap"),
        ({"tokenizer.ggml.remove_extra_whitespaces": True}, "remove_extra_whitespaces"),
        ({"tokenizer.ggml.scores": [0.0]}, "one value per token"),
        ({"general.name": "Phi-3-mini-4k-instruct"}, "phi-3 .RSTRIP"),
    ],
)
def test_refused_by_name(change, match):
    meta = {**gguf_meta(train("bpe", gemma=False), gemma=False), **change}
    with pytest.raises(ValueError, match=match):
        Tokenizer.from_gguf_metadata(meta)


def test_no_byte_fallback_refused():
    meta = gguf_meta(train("bpe", gemma=False), gemma=False)
    meta["tokenizer.ggml.tokens"] = ["<0x41>x" if t == "<0x41>" else t for t in meta["tokenizer.ggml.tokens"]]
    with pytest.raises(ValueError, match="without byte fallback.*<0x41>"):
        Tokenizer.from_gguf_metadata(meta)


def _segments(sp: spm.SentencePieceProcessor, ids: list[int]) -> list[bytes | int]:
    """`ids` with each run of consecutive byte pieces (<0xXX>) joined into its bytes."""
    out: list[bytes | int] = []
    run = bytearray()
    for i in ids:
        if sp.is_byte(i):
            run.append(int(sp.id_to_piece(i)[3:5], 16))
            continue
        if run:
            out.append(bytes(run))
            run = bytearray()
        out.append(i)
    return [*out, bytes(run)] if run else out


def _valid_utf8(run: bytes) -> bool:
    try:
        run.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def byte_fallback_decode(sp: spm.SentencePieceProcessor, ids: list[int]) -> str:
    """What a `tokenizers` decoder with ByteFallback (the Llama and Gemma tokenizer.json's, which
    vLLM decodes with) makes of `ids`: sentencepiece's text, but a run of byte pieces that is not
    valid UTF-8 gives one U+FFFD per byte, where sentencepiece replaces only the invalid bytes
    (<0x95><0x3F>: "\ufffd\ufffd" against "\ufffd?")."""
    out: list[str] = []
    for seg in _segments(sp, ids):
        if isinstance(seg, bytes):
            out.append(seg.decode("utf-8") if _valid_utf8(seg) else "\ufffd" * len(seg))
        elif not sp.is_control(seg):  # special tokens are skipped in outputs
            out.append(sp.id_to_piece(seg).replace("\u2581", " "))
    return "".join(out)


def test_gemma_gguf_with_sentencepiece_vocabulary_generates(tmp_path, monkeypatch):
    """A whole Gemma 2 GGUF (gguf_convert.py's rules) carrying the converter's SentencePiece
    vocabulary loads through LLM: the prompt is sentencepiece's ids after BOS, and greedy tokens
    equal transformers' on the source checkpoint."""
    import transformers as tf

    from prefixkv import LLM, SamplingParams
    from prefixkv.sampling_params import StructuredOutputsParams

    from . import gguf_convert

    sp = train("bpe", gemma=True)
    meta = gguf_meta(sp, gemma=True)

    def vocabulary(w, vocab: int, bos: int, eos: int) -> None:  # Gemma2Model.set_vocab
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_scores(meta["tokenizer.ggml.scores"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_unk_token_id(sp.unk_id())
        w.add_pad_token_id(sp.pad_id())
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)

    monkeypatch.setattr(gguf_convert, "_vocabulary", vocabulary)
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(
        vocab_size=sp.get_piece_size(),
        bos_token_id=sp.bos_id(),
        eos_token_id=sp.eos_id(),
        pad_token_id=sp.pad_id(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=16,
        architectures=["Gemma2ForCausalLM"],
    )
    cfg._attn_implementation = "eager"
    hf = tf.Gemma2ForCausalLM(cfg).eval()
    path = tmp_path / "gemma2-spm.gguf"
    gguf_convert.write_gguf(path, hf)

    prompt = "<start_of_turn>user\nThe prefix cache keeps  blocks.<end_of_turn>\n<start_of_turn>model\n"
    ids = [sp.bos_id()] + sentencepiece_encode(sp, meta, prompt)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    expected = out[0, len(ids) :].tolist()
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=32, block_size=8, max_model_len=96)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (result,) = llm.generate([prompt], params, use_tqdm=False)
    assert result.prompt_token_ids == ids
    assert result.outputs[0].token_ids == expected
    assert result.outputs[0].text == byte_fallback_decode(sp, expected)
    if all(_valid_utf8(seg) for seg in _segments(sp, expected) if isinstance(seg, bytes)):
        assert result.outputs[0].text == sp.decode(expected)
    # a grammar over this vocabulary: pieces with U+2581 and byte tokens spell the choices
    choices = ["yes", "no", "maybe not", "日本"]
    so = StructuredOutputsParams(choice=choices)
    for out in llm.generate([prompt] * 3, SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs=so)):
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
