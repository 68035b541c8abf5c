"""prefixkv's greedy float32 generation against transformers' `generate`, token for token, on a tiny
random Llama built with transformers' own classes, in one process: the check that
bench/emulated_aarch64.sh runs on an emulated aarch64 machine (it runs anywhere).

    python bench/emulated_aarch64_check.py --folder DIR [--max-tokens 24]

The checkpoint is made in DIR on the first call (an HF folder with a byte-level tokenizer, as the
tests make theirs) and reused after. Its head dim is 64, one the native attention kernels take, so
that a run with them on goes through them. Which native CPU kernels run is prefixkv's own logging's
to say (INFO, on stderr) and is printed at the end; run it again with PREFIXKV_KERNEL_CHOICE=native
(every applicable native kernel, whatever the timing says) and PREFIXKV_CPU_KERNELS=0 (none) to
cover both paths. Exits 1 where any token differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.* (the repo's root)

# prompts as token ids: two share a 40-token prefix (a prefix-cache hit on the second pass), one is
# a single token
PROMPTS = [
    [256, *range(10, 50)],
    [256, *range(10, 50), 77, 78, 79],
    [256],
    [256, *range(120, 130)],
]
CLI_PROMPT = [256, 10, 11, 12]  # "w256 w10 w11 w12" in FOLDER/words


def make_checkpoint(folder: Path) -> None:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from bench.byte_tokenizer import write_byte_tokenizer

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,  # head dim 64
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=256,
        eos_token_id=257,
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    write_byte_tokenizer(folder)
    # a second tokenizer, one word a token (w0 ... w299, decoded without spaces): text that names its tokens
    words = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(300)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.Metaspace()
    (folder / "words").mkdir(exist_ok=True)
    words.save(str(folder / "words" / "tokenizer.json"))
    (folder / "words" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w256", "eos_token": "w257"}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, required=True, help="the checkpoint's folder (made if missing)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import torch
    import transformers as tf

    import prefixkv
    from prefixkv import LLM, SamplingParams
    from prefixkv.model import row_split
    from prefixkv.model.kernels import build, ops

    print(
        f"machine {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__} "
        f"(ATen CPU capability {torch.backends.cpu.get_cpu_capability()}), transformers {tf.__version__}, "
        f"prefixkv from {Path(prefixkv.__file__).parent}",
        flush=True,
    )
    if not (args.folder / "words" / "tokenizer.json").exists():
        start = time.perf_counter()
        args.folder.mkdir(parents=True, exist_ok=True)
        make_checkpoint(args.folder)
        print(f"made the checkpoint in {args.folder} ({time.perf_counter() - start:.1f} s)", flush=True)

    start = time.perf_counter()
    hf = tf.LlamaForCausalLM.from_pretrained(args.folder, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False, pad_token_id=257)
            want.append(out[0, len(ids) :].tolist())
        # `prefixkv generate` (bench/emulated_aarch64.sh) prints text: with FOLDER/words as its tokenizer
        # each token prints as its own word (w0 ... w299), so its text names the very tokens
        out = hf.generate(torch.tensor([CLI_PROMPT]), max_new_tokens=16, do_sample=False, pad_token_id=257)
        words = "".join(f"w{i}" for i in out[0, len(CLI_PROMPT) :].tolist())
        (args.folder / "expected-cli.txt").write_text(words + "\n")
    print(f"transformers generate: {time.perf_counter() - start:.1f} s", flush=True)

    start = time.perf_counter()
    llm = LLM(str(args.folder), dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20)
    print(f"prefixkv LLM(): {time.perf_counter() - start:.1f} s", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    failures = 0
    for attempt in ("first pass", "second pass (prefix cache hits)"):
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        seconds = time.perf_counter() - start
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same = g == w
            failures += not same
            print(f"{attempt}: prompt {i} ({len(PROMPTS[i])} tokens): {'equal' if same else 'DIFFERENT'} {g}")
            if not same:
                print(f"  transformers: {w}")
        cached = [o.num_cached_tokens for o in outs]
        print(f"{attempt}: {seconds:.1f} s, cached prompt tokens {cached}", flush=True)

    made = ops.choice(torch.float32)
    library = ops.library_name() if ops.enabled() else "(switched off)"  # library_name() would build it
    print(
        f"native CPU kernels: available={ops.available()} library={library} "
        f"cpu_arch={build.arch()} float32 choice={made}; row-split products: available={row_split.available()}"
    )
    print(f"RESULT: {'all tokens equal' if not failures else f'{failures} prompt(s) differ'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
