"""Mixture-of-experts layers (model/moe.py) against transformers' own Mixtral, Qwen2-MoE and
Qwen3-MoE on tiny random checkpoints: the grouped expert computation against a per-token one, HF
folders in both expert layouts, GGUF files with stacked expert tensors, and LoRA on MoE models."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig
from prefixkv.model.moe import Experts, SparseMoeBlock
from prefixkv.model.tokenizer import _bytes_to_unicode

from ..conftest import hf_greedy
from .model_helpers import run_logits
from .test_model_hf_folder import _write_tokenizer

VOCAB = 288
KINDS = ["qwen3_moe", "mixtral", "qwen2_moe"]


def make_moe(kind: str, **extra):
    """A tiny random transformers MoE model: 8 experts, top 2 (Qwen2-MoE: a shared expert and a
    dense second layer)."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=256,
        eos_token_id=257,
        num_experts_per_tok=2,
    )
    common.update(extra)
    if kind == "qwen3_moe":
        common.setdefault("head_dim", 24)
        cfg = tf.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, **common)
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=8, **common)
        cls = tf.MixtralForCausalLM
    elif kind == "qwen2_moe":
        common.setdefault("mlp_only_layers", [1])
        cfg = tf.Qwen2MoeConfig(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, **common)
        cls = tf.Qwen2MoeForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return m


def _prompts(seed, n=4):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _greedy(lm, prompt, max_new):
    """Greedy tokens of our model, prefill then one decode step at a time, through the paged cache."""
    caches = allocate_kv_cache(lm.config, 16, 8)
    blocks = list(range(16))
    tokens = list(prompt)
    logits, _ = run_logits(lm.model, caches, [(tokens, blocks, 0)], 8)
    out = []
    for _ in range(max_new):
        out.append(int(logits[-1].argmax()))
        tokens.append(out[-1])
        logits, _ = run_logits(lm.model, caches, [(tokens, blocks, len(tokens) - 1)], 8)
    return out


def test_grouped_experts_equal_a_per_token_computation():
    """The sort-by-expert grouping gives every token the weighted sum of its own experts, for a
    top-k above 2 (where the summation order matters) and with experts no token chose."""
    torch.manual_seed(1)
    E, H, I, T, k = 6, 16, 8, 13, 3
    experts = Experts(E, H, I)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(T, H)
    index = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])  # expert E-1 never chosen
    weight = torch.rand(T, k)
    experts.requires_grad_(False)
    got = experts(x, index, weight)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(index[t, j])
            g, u = (x[t] @ experts.gate_up_proj[e].T).split(I)
            want[t] += weight[t, j] * ((torch.nn.functional.silu(g) * u) @ experts.down_proj[e].T)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(experts(x[:0], index[:0], weight[:0]), x[:0])  # an empty step


@pytest.mark.parametrize("kind", KINDS)
def test_moe_block_matches_transformers(kind):
    hf = make_moe(kind)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    ours = SparseMoeBlock(config).requires_grad_(False)
    ref = hf.model.layers[0].mlp
    sd = ref.state_dict()
    I = config.moe_intermediate_size
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        ours.experts.gate_up_proj.copy_(sd["experts.gate_up_proj"])
        ours.experts.down_proj.copy_(sd["experts.down_proj"])
        if ours.shared_expert is not None and ours.shared_expert_gate is not None:
            S = config.shared_expert_intermediate_size
            ours.shared_expert.gate_up_proj.weight[:S].copy_(sd["shared_expert.gate_proj.weight"])
            ours.shared_expert.gate_up_proj.weight[S:].copy_(sd["shared_expert.up_proj.weight"])
            ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
            ours.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x)[0]
        got = ours(x[0])
    assert I == (32 if kind != "mixtral" else 96)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert len(set(ours.route(x[0])[0].flatten().tolist())) >= 6  # the tokens spread over the experts


@pytest.mark.parametrize("kind", KINDS)
def test_hf_folder_in_both_expert_layouts(tmp_path, kind):
    """save_pretrained writes one tensor per expert (Mixtral: block_sparse_moe.experts.N.w1/w2/w3);
    transformers 5's in-memory layout stacks them (experts.gate_up_proj / down_proj): both load."""
    from safetensors.torch import save_file

    hf = make_moe(kind)
    prompts = _prompts(kind, 3)
    want = [hf_greedy(hf, p, 6) for p in prompts]
    per_expert, stacked = tmp_path / "per_expert", tmp_path / "stacked"
    hf.save_pretrained(per_expert, safe_serialization=True)
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, str(stacked / "model.safetensors"))
    for folder in (per_expert, stacked):
        _write_tokenizer(folder)
        lm = load_model(str(folder))
        assert lm.config.num_experts == 8 and lm.config.num_experts_per_tok == 2
        assert [_greedy(lm, p, 6) for p in prompts] == want, folder.name


def test_config_fields_and_dense_layers():
    hf = make_moe("qwen2_moe", decoder_sparse_step=2, num_hidden_layers=4, mlp_only_layers=[3])
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert cfg.architecture == "Qwen2MoeForCausalLM" and cfg.attention_bias and not cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert cfg.shared_expert_intermediate_size == 48
    assert ModelConfig.from_hf_dict(make_moe("mixtral").config.to_dict()).norm_topk_prob
    qwen3 = {**make_moe("qwen3_moe").config.to_dict(), "num_experts_per_tok": 9}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(qwen3)


# ------------------------------------------------------------------------------------------ GGUF
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe"}
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(path, hf, kind, quantize_experts=False):
    """`hf`'s weights as llama.cpp's convert_hf_to_gguf.py lays them out: experts stacked per
    matrix (ffn_{gate,up,down}_exps, [E, rows, cols]), the router ffn_gate_inp, Qwen2-MoE's shared
    expert (*_shexp) and its gate (ffn_gate_inp_shexp, 1-D), Q/K permuted for "llama" (Mixtral)."""
    import gguf

    cfg = hf.config
    arch = _GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(8)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if kind != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = sorted(_bytes_to_unicode().values()) + ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(False)
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    tensors: list[tuple[str, np.ndarray]] = []
    for n, t in hf.state_dict().items():
        a = t.float().numpy()
        if not n.startswith("model.layers."):
            tensors.append((globals_[n], a))
            continue
        i, rest = n[len("model.layers.") :].split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(a, 2, axis=1)
            tensors += [(f"blk.{i}.ffn_gate_exps.weight", gate), (f"blk.{i}.ffn_up_exps.weight", up)]
            continue
        if rest == "mlp.shared_expert_gate.weight":
            tensors.append((f"blk.{i}.ffn_gate_inp_shexp.weight", a.reshape(-1)))
            continue
        g = f"blk.{i}.{_PER_LAYER[rest]}"
        if kind == "mixtral" and g.endswith("attn_q.weight"):
            a = _llamacpp_permute(a, cfg.num_attention_heads)
        if kind == "mixtral" and g.endswith("attn_k.weight"):
            a = _llamacpp_permute(a, cfg.num_key_value_heads)
        tensors.append((g, a))
    for g, a in tensors:
        if quantize_experts and "_exps" in g:
            q = gguf.quants.quantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_round_trip(tmp_path, kind):
    """The HF weights written into a GGUF (float32) load to the same greedy tokens; Qwen2-MoE's
    dense second layer is found by its missing router."""
    hf = make_moe(kind)
    path = tmp_path / f"{kind}.gguf"
    write_moe_gguf(path, hf, kind)
    lm = load_model(str(path))
    want_arch = {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
    }
    cfg = lm.config
    assert cfg.architecture == want_arch[kind] and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (kind != "qwen2_moe")  # llama.cpp's rule for each architecture
    assert cfg.mlp_only_layers == ((1,) if kind == "qwen2_moe" else ())
    prompts = _prompts(kind, 3)
    assert [_greedy(lm, p, 6) for p in prompts] == [hf_greedy(hf, p, 6) for p in prompts]


def test_gguf_quantized_experts_close(tmp_path):
    """Q8_0 expert tensors (3-D, quantized row by row) dequantize to the source weights."""
    hf = make_moe("qwen3_moe")
    path = tmp_path / "q8.gguf"
    write_moe_gguf(path, hf, "qwen3_moe", quantize_experts=True)
    lm = load_model(str(path))
    ours = lm.model.layers[0].mlp.experts.gate_up_proj
    src = hf.model.layers[0].mlp.experts.gate_up_proj
    assert (ours - src).abs().max() < 0.01 * src.abs().max()


def test_gguf_other_gating_refused():
    meta = {
        "general.architecture": "qwen3moe",
        "qwen3moe.embedding_length": 64,
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.block_count": 1,
        "qwen3moe.feed_forward_length": 96,
        "qwen3moe.vocab_size": 300,
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_gating_func": 3,  # llama.cpp's softmax over the chosen weights: not built
    }
    with pytest.raises(ValueError, match="expert_gating_func"):
        ModelConfig.from_gguf_metadata(meta, {"blk.0.ffn_gate_inp.weight"})
    sigmoid = ModelConfig.from_gguf_metadata({**meta, "qwen3moe.expert_gating_func": 2}, {"blk.0.ffn_gate_inp.weight"})
    assert sigmoid.router_scoring == "sigmoid" and not sigmoid.router_selection_bias


# ------------------------------------------------------------------------------------------ LoRA
def test_lora_on_moe_attention_only(tmp_path):
    """An adapter on the attention projections of a MoE model runs (equal to PEFT); one on expert
    weights, or on the MLP of a MoE layer, is refused by name."""
    from safetensors.torch import save_file

    from prefixkv import LLM, SamplingParams
    from prefixkv.lora import LoRARequest

    from ..lora.conftest import peft_greedy, write_adapter

    base = tmp_path / "base"
    make_moe("qwen3_moe").save_pretrained(base, safe_serialization=True)
    _write_tokenizer(base)
    attn = tmp_path / "attn"
    write_adapter(base, attn, seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    prompts = _prompts("lora", 2)
    llm = LLM(str(base), dtype="float32", device="cpu", num_blocks=48, block_size=8, max_model_len=64, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompts, params, lora_request=LoRARequest("attn", 1, str(attn)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == peft_greedy(base, attn, prompts, 6)
    # an adapter for the per-expert modules older transformers had (mlp.experts.N.gate_proj)
    experts = tmp_path / "experts"
    experts.mkdir()
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}
    (experts / "adapter_config.json").write_text(json.dumps(cfg))
    pre = "base_model.model.model.layers.0.mlp"
    save_file(
        {
            f"{pre}.experts.0.gate_proj.lora_A.weight": torch.zeros(2, 64),
            f"{pre}.experts.0.gate_proj.lora_B.weight": torch.zeros(32, 2),
        },
        str(experts / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        llm.generate(prompts, params, lora_request=LoRARequest("experts", 2, str(experts)), use_tqdm=False)
    # a dense-MLP target name on an MoE layer
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(
        {f"{pre}.gate_proj.lora_A.weight": torch.zeros(2, 64), f"{pre}.gate_proj.lora_B.weight": torch.zeros(96, 2)},
        str(dense / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="layer 0 is a mixture-of-experts layer"):
        llm.generate(prompts, params, lora_request=LoRARequest("dense", 3, str(dense)), use_tqdm=False)
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
