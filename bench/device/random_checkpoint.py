"""A random-weight checkpoint of a model shape users serve, for the GPU figures: random weights
read and multiply at the same speed as trained ones, so nothing needs downloading. Written as an
HF folder with transformers' own classes (config.json, safetensors) and the default model's
tokenizer (SmolLM2's vocabulary, from the embedded GGUF), so the engine and transformers load it as
they load any checkpoint.

    python3 bench/device/random_checkpoint.py OUT [--shape SHAPE] [--device cuda] [--layers N] [--byte-tokenizer]

SHAPE: llama-1b (default), llama-3b, llama-8b, qwen2.5-0.5b, gemma3-1b, falcon-h1-0.5b, qwen3-next-small,
gpt-oss-20b, lfm2-1.2b, moonlight-16b, gemma4-e2b or tiny.

The weights are drawn on --device (a GPU draws a 1B model's in well under a second) in bfloat16;
--layers overrides the shape's depth (a CPU smoke with --layers 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from bench.byte_tokenizer import write_byte_tokenizer  # noqa: E402

# Llama 3.2 1B / 3B, Llama 3.1 8B and Qwen2.5 0.5B's shapes, with SmolLM2's 49,152-token vocabulary
# ("family" picks transformers' config class; Llama's when absent)
SHAPES: dict[str, dict[str, object]] = {
    # a model whose forward costs next to nothing: what the engine's own work per step costs
    # (bench/host_overhead.py)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        family="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    # today's other families, near their published shapes: sliding and full layers (KV-cache
    # groups), a Mamba2 mixer beside attention in every layer, gated delta nets with routed experts
    # (fewer layers and experts than Qwen3-Next-80B-A3B: its per-layer shape, not its size)
    "gemma3-1b": dict(
        family="gemma3",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    "falcon-h1-0.5b": dict(
        family="falcon_h1",
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=36,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        mamba_d_ssm=1536,
        mamba_n_heads=24,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        tie_word_embeddings=False,
    ),
    "qwen3-next-small": dict(
        family="qwen3_next",
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    ),
    # gpt-oss-20b's layer (sliding and full layers in turn, sinks, 32 experts top 4); --layers 2
    # keeps one of each on a CPU (~1.9B parameters with SmolLM2's vocabulary)
    "gpt-oss-20b": dict(
        family="gpt_oss",
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        tie_word_embeddings=False,
    ),
    # LFM2-1.2B: gated short convolutions, attention at six of sixteen layers, the MLP's width
    # after LFM2's adjustment (12,288 -> 8,192)
    "lfm2-1.2b": dict(
        family="lfm2",
        hidden_size=2048,
        intermediate_size=12288,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        full_attn_idxs=[2, 5, 8, 10, 12, 14],
        tie_word_embeddings=True,
    ),
    # Moonlight-16B-A3B (Kimi's DeepseekV3ForCausalLM): multi-head latent attention without a
    # query rank, 64 experts top 6 beside two shared ones after a dense first layer; --layers 2
    # keeps one of each on a CPU (~0.9B parameters with SmolLM2's vocabulary)
    "moonlight-16b": dict(
        family="deepseek_v3",
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.446,
        tie_word_embeddings=False,
    ),
    # Gemma 4 E2B: sliding layers of 256-wide heads beside every sixth full one of 512, one K/V
    # head, per-layer inputs of 256, the last 20 of 35 layers reading earlier layers' K/V with
    # MLPs twice as wide; --layers N keeps the share of KV-shared layers (20 / 35 of N)
    "gemma4-e2b": dict(
        family="gemma4",
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=35,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        sliding_window=512,
        hidden_size_per_layer_input=256,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def write_tokenizer(out: Path) -> int:
    """The default model's tokenizer as tokenizer.json + tokenizer_config.json; its vocabulary size."""
    from prefixkv.model.loader import default_model_path, load_tokenizer

    tok = load_tokenizer(default_model_path())
    tok.backend.save(str(out / "tokenizer.json"))
    cfg = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return int(tok.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    ap.add_argument(
        "--byte-tokenizer", action="store_true", help="a byte-level tokenizer of 258 tokens instead of SmolLM2's"
    )
    args = ap.parse_args()
    import transformers as tf

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(out) if args.byte_tokenizer else write_tokenizer(out)  # bench/byte_tokenizer.py
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shared, depth = shape.get("num_kv_shared_layers"), shape["num_hidden_layers"]
        if isinstance(shared, int) and isinstance(depth, int):
            shape["num_kv_shared_layers"] = shared * args.layers // depth
        shape["num_hidden_layers"] = args.layers
    family = shape.pop("family", "llama")
    if family == "gemma4":
        shape["vocab_size_per_layer_input"] = vocab
    config_class, model_class = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "falcon_h1": (tf.FalconH1Config, tf.FalconH1ForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "lfm2": (tf.Lfm2Config, tf.Lfm2ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM),
    }[str(family)]
    # the rotary base where the family takes it so (the others keep their config's default)
    settings: dict[str, object] = dict(rope_theta=500000.0) if family in ("llama", "qwen2") else {}
    settings["norm_eps" if family == "lfm2" else "rms_norm_eps"] = 1e-5
    settings.update(shape)
    config = config_class(
        vocab_size=vocab,
        max_position_embeddings=8192,
        bos_token_id=None,
        eos_token_id=None,
        **settings,
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(default_dtype)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    if family == "lfm2":  # the released configs' keys that transformers 5 no longer writes and vLLM reads
        d = json.loads((out / "config.json").read_text())
        d.update(conv_dim=d["hidden_size"], conv_dim_out=d["hidden_size"], block_dim=d["hidden_size"])
        d["block_ff_dim"] = d["intermediate_size"]
        (out / "config.json").write_text(json.dumps(d, indent=2))
    if family == "deepseek_v3":  # the released configs' routing keys, which vLLM reads (transformers 5 writes none)
        d = json.loads((out / "config.json").read_text())
        d.update(topk_method="noaux_tc", scoring_func="sigmoid")
        (out / "config.json").write_text(json.dumps(d, indent=2))
    print(
        f"{args.shape}{f' ({args.layers} layers)' if args.layers else ''}: {params / 1e9:.2f}B parameters, "
        f"bfloat16, written to {out} in {time.perf_counter() - start:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
