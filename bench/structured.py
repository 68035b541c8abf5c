"""Per-token cost of grammar-constrained decoding with xgrammar and llguidance on the default
model's vocabulary (SmolLM2, 49,152 byte-level BPE tokens): for a JSON schema, a regex and a free
JSON object, walk a valid output token by token and time, per token, computing the allowed-token
bitmask, applying it to a float32 logits row (prefixkv's own apply, the same for both), and
advancing the matcher. Prints medians (and the
one-off costs: tokenizer info, grammar compilation); then a step's masks for a batch of sequences,
a row each against one batch call.

    .venv/bin/python bench/structured.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from prefixkv.constraints.grammar import apply_bitmask  # noqa: E402
from prefixkv.model.gguf_file import GGUFFile  # noqa: E402
from prefixkv.model.loader import default_model_path  # noqa: E402
from prefixkv.model.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["math", "poetry", "engines", "music"]}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
SCHEMA_DOC = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.org",
        "tags": ["math", "poetry", "engines"],
        "address": {"city": "London", "zip": "W1"},
    }
)
REGEX = r"(\d{3}-\d{3}-\d{4}|[A-Z][a-z]+ [A-Z][a-z]+), born (18|19|20)\d\d in [A-Z][a-z]+"
REGEX_DOC = "Ada Lovelace, born 1815 in London"
OBJECT_DOC = json.dumps({"items": [{"id": i, "ok": i % 2 == 0, "label": f"item number {i}"} for i in range(4)]})


def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def walk(
    fill: Callable[[], None], apply: Callable[[torch.Tensor], None], accept: Callable[[int], bool], ids: list[int]
):
    """Per-token seconds for (mask, apply, accept) along `ids`."""
    logits = torch.randn(1, 49152)
    mask, app, acc = [], [], []
    for t in ids:
        a = time.perf_counter()
        fill()
        b = time.perf_counter()
        x = logits.clone()
        c = time.perf_counter()
        apply(x)
        d = time.perf_counter()
        ok = accept(t)
        e = time.perf_counter()
        if not ok:
            raise RuntimeError(f"token {t} rejected")
        mask.append(b - a)
        app.append(d - c)
        acc.append(e - d)
    return mask, app, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="walks per case (medians over all tokens)")
    args = ap.parse_args()
    import llguidance
    import llguidance.torch as llt
    import xgrammar as xgr

    tok = load_tokenizer()
    backend = tok.backend.to_str()
    eos = sorted(tok.eos_token_ids)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * tok.vocab_size
    for piece, i in vocab.items():
        encoded[i] = piece
    cases = {
        "json_schema": (SCHEMA_DOC, lambda: ("schema", SCHEMA)),
        "regex": (REGEX_DOC, lambda: ("regex", REGEX)),
        "json_object": (OBJECT_DOC, lambda: ("object", None)),
    }

    def xgr_setup():
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
        info = xgr.TokenizerInfo(
            encoded, meta["vocab_type"], vocab_size=tok.vocab_size, stop_token_ids=eos, add_prefix_space=False
        )
        return xgr.GrammarCompiler(info, cache_enabled=False)

    def llg_setup():
        return llguidance.LLTokenizer(backend, n_vocab=tok.vocab_size, eos_token=eos)

    t_xgr, compiler = timed(xgr_setup)
    t_llg, lltok = timed(llg_setup)
    print(
        f"vocabulary: {tok.vocab_size} tokens; tokenizer info: xgrammar {t_xgr * 1e3:.0f} ms, "
        f"llguidance {t_llg * 1e3:.0f} ms"
    )
    print(
        f"{'case':<12} {'engine':<11} {'compile ms':>10} {'mask us':>8} {'apply us':>9} {'accept us':>10}"
        f" {'total us':>9}"
    )
    for name, (doc, spec) in cases.items():
        ids = tok.encode(doc) + eos[:1]
        kind, value = spec()
        for engine in ("xgrammar", "llguidance"):
            masks, apps, accs, compiles = [], [], [], []
            for _ in range(args.repeats):
                if engine == "xgrammar":
                    compile_fn = {
                        "schema": lambda: compiler.compile_json_schema(json.dumps(value)),  # noqa: B023
                        "regex": lambda: compiler.compile_regex(value),  # noqa: B023
                        "object": lambda: compiler.compile_builtin_json_grammar(),
                    }[kind]
                    secs, compiled = timed(compile_fn)
                    m = xgr.GrammarMatcher(compiled)
                    bm = xgr.allocate_token_bitmask(1, tok.vocab_size)
                    res = walk(
                        lambda: m.fill_next_token_bitmask(bm),  # noqa: B023
                        lambda x: apply_bitmask(x[0], bm[0], tok.vocab_size),  # noqa: B023
                        m.accept_token,
                        ids,
                    )
                else:
                    grammar_fn = {
                        "schema": lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value)),  # noqa: B023
                        "regex": lambda: llguidance.LLMatcher.grammar_from_regex(value),  # noqa: B023
                        "object": lambda: llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}'),
                    }[kind]
                    secs, lm = timed(lambda: llguidance.LLMatcher(lltok, grammar_fn()))  # noqa: B023
                    bm = llt.allocate_token_bitmask(1, tok.vocab_size)
                    res = walk(
                        lambda: llt.fill_next_token_bitmask(lm, bm),  # noqa: B023
                        lambda x: apply_bitmask(x[0], bm[0], tok.vocab_size),  # noqa: B023
                        lm.consume_token,  # type: ignore[attr-defined]
                        ids,
                    )
                compiles.append(secs)
                masks += res[0]
                apps += res[1]
                accs += res[2]
            med = [statistics.median(v) * 1e6 for v in (masks, apps, accs)]
            print(
                f"{name:<12} {engine:<11} {statistics.median(compiles) * 1e3:>10.2f} {med[0]:>8.0f} {med[1]:>9.0f}"
                f" {med[2]:>10.0f} {sum(med):>9.0f}"
            )
    print(f"({args.repeats} walks per case; torch threads: {torch.get_num_threads()})")
    # applying the masks of a JSON-schema walk (strings: most tokens allowed; structure: few) with
    # xgrammar's CPU kernel and with prefixkv's
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    masks = []
    for t in tok.encode(SCHEMA_DOC):
        bm = xgr.allocate_token_bitmask(1, tok.vocab_size)
        m.fill_next_token_bitmask(bm)
        masks.append(bm)
        m.accept_token(t)
    logits = torch.randn(1, tok.vocab_size)
    kernels = {
        "xgrammar.apply_token_bitmask_inplace": lambda x, bm: xgr.apply_token_bitmask_inplace(x, bm),
        "prefixkv apply_bitmask": lambda x, bm: apply_bitmask(x[0], bm[0], tok.vocab_size),
    }
    for name, fn in kernels.items():
        secs = []
        for _ in range(args.repeats):
            for bm in masks:
                x = logits.clone()
                t0 = time.perf_counter()
                fn(x, bm)
                secs.append(time.perf_counter() - t0)
        print(
            f"apply a mask ({len(masks)} masks of a JSON walk), {name}: median {statistics.median(secs) * 1e6:.0f} us"
        )
    batch_fills(tok, args.repeats)


def batch_fills(tok: Tokenizer, repeats: int) -> None:
    """A step's masks for a batch of JSON-schema sequences, each stopped at another point of the
    walk: filled a row each (RequestGrammar.fill) against one batch call on the backend's threads
    (grammar.fill_next, what a step does)."""
    from prefixkv.constraints.grammar import GrammarEngine, fill_next, fill_threads
    from prefixkv.sampling_params import StructuredOutputsParams

    ids = tok.encode(SCHEMA_DOC)
    for backend in ("xgrammar", "guidance"):
        engine = GrammarEngine(tok, tok.vocab_size, sorted(tok.eos_token_ids), backend)
        compiled = engine.compile(StructuredOutputsParams(json=SCHEMA))
        for batch in (32, 256):
            grammars = [engine.matcher(compiled) for _ in range(batch)]
            for i, g in enumerate(grammars):
                for t in ids[: (i * 7) % len(ids)]:
                    g.accept(t)
            masks = torch.zeros((batch, grammars[0].num_words), dtype=torch.int32)
            rows = list(range(batch))
            one_by_one, batched = [], []
            for _ in range(repeats * 4):
                t0 = time.perf_counter()
                for i, g in enumerate(grammars):
                    g.fill(masks[i : i + 1])
                t1 = time.perf_counter()
                fill_next(grammars, [()] * batch, masks, rows)
                t2 = time.perf_counter()
                one_by_one.append(t1 - t0)
                batched.append(t2 - t1)
            a, b = statistics.median(one_by_one) * 1e3, statistics.median(batched) * 1e3
            print(
                f"masks of a step, batch {batch}, {backend}: a row each {a:.2f} ms, one batch call "
                f"({fill_threads()} threads) {b:.2f} ms ({a / b:.1f}x)"
            )


if __name__ == "__main__":
    main()
