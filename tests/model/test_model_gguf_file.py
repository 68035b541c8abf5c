"""Single-file GGUF loading: a tiny model written with gguf.GGUFWriter (Q8_0 matrices, llama.cpp
Q/K row permutation for llama), loaded by us and by transformers from the same file."""

import contextlib
import os

import numpy as np
import pytest
import torch

from prefixkv.memory.block_tensors import allocate_kv_cache
from prefixkv.model import load_model
from prefixkv.model.kernels import ops
from prefixkv.model.layers import DualLayoutLinear, NativeLinear, PackedLinear, TransposedLinear, packed_linear_works
from prefixkv.model.tokenizer import _bytes_to_unicode

from .model_helpers import run_logits, without_blocked_linear

VOCAB = 288


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, kind):
    import gguf
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
    )
    if kind == "llama":
        hf = tf.LlamaForCausalLM(tf.LlamaConfig(rope_theta=10000.0, **common))
    else:
        hf = tf.Qwen2ForCausalLM(tf.Qwen2Config(rope_theta=10000.0, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in n else 0.08 * torch.randn_like(p))
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), kind)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = sorted(_bytes_to_unicode().values()) + ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]
    w.add_token_list(toks)
    w.add_token_types([1] * 256 + [3] * (VOCAB - 256))
    w.add_token_scores([0.0] * VOCAB)  # transformers' tokenizer conversion reads them
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(False)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for n, t in hf.state_dict().items():
        if n.startswith("model.layers."):
            i, rest = n[len("model.layers.") :].split(".", 1)
            g = f"blk.{i}.{per[rest]}"
        else:
            g = names[n]
        a = t.float().numpy()
        if kind == "llama" and g.endswith("attn_q.weight"):
            a = _llamacpp_permute(a, cfg.num_attention_heads)
        if kind == "llama" and g.endswith("attn_k.weight"):
            a = _llamacpp_permute(a, cfg.num_key_value_heads)
        if a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gguf_file_matches_transformers_gguf(tmp_path, kind):
    pytest.importorskip("accelerate", reason="transformers needs `accelerate` to load a GGUF model")
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{kind}.gguf"
    src = _write_gguf(path, kind)
    lm = load_model(str(path))
    assert lm.config.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    assert lm.config.attention_bias == (kind == "qwen2") and not lm.config.tie_word_embeddings
    assert lm.tokenizer.eos_token_ids == {257} and lm.tokenizer.decode(lm.tokenizer.encode("héllo")) == "héllo"
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
        src_logits = src(torch.tensor([ids])).logits[0]
    caches = allocate_kv_cache(lm.config, 16, 4)
    blocks = [9, 2, 14, 0, 7, 5, 11, 3]
    a, _ = run_logits(lm.model, caches, [(ids[:13], blocks, 0)], 4)
    b, _ = run_logits(lm.model, caches, [(ids, blocks, 13)], 4)
    ours = torch.cat([a, b])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # and close to the unquantized source model (Q8_0 error only): the permutation is undone
    assert (ours - src_logits).abs().max() < 0.05 * src_logits.abs().max()


def test_bf16_runs_close_to_fp32(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama")
    f32 = load_model(str(path))
    b16 = load_model(str(path), dtype=torch.bfloat16)
    assert b16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = list(range(40, 60))
    out = []
    for lm, dt in ((f32, torch.float32), (b16, torch.bfloat16)):
        caches = allocate_kv_cache(lm.config, 8, 8, dtype=dt)
        lg, _ = run_logits(lm.model, caches, [(ids, [3, 1, 6], 0)], 8)
        out.append(lg.float())
    assert (out[0] - out[1]).abs().max() < 0.05 * out[0].abs().max()


def test_default_model_file_found(default_gguf_path):
    assert os.path.basename(default_gguf_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(default_gguf_path)


@pytest.mark.skipif(not packed_linear_works(), reason="no oneDNN bfloat16 linear on this CPU/torch")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases go through both kernels
@pytest.mark.parametrize("bound", ["native", "default", "exceeded"])
@pytest.mark.usefixtures("every_native_kernel")  # "native": the many-row linear
def test_bf16_laid_out_weights_match_plain_bf16(tmp_path, monkeypatch, kind, bound):
    """ModelRunner lays bfloat16 CPU weights out once for the native kernels where the many-row one
    was chosen ("native": NativeLinear); else for oneDNN and, where the CPU has AVX512-BF16 and the
    weights are under the size bound, a second time for the native small-batch kernel
    (DualLayoutLinear): same logits as plain F.linear up to bfloat16 rounding, the head laid out
    too, and doing it twice is a no-op. The prefill of 18 rows goes through oneDNN (or the blocked
    kernel), the steps of 1 and 2 rows through the small-batch kernel."""
    from prefixkv.model import llama

    if bound == "exceeded":
        monkeypatch.setattr(llama, "DUAL_LAYOUT_MAX_BYTES", 1024)
        monkeypatch.setattr(llama, "DUAL_LAYOUT_MEMORY_SHARE", 0.0)
    path = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(path, kind)
    plain, packed = load_model(str(path), dtype=torch.bfloat16), load_model(str(path), dtype=torch.bfloat16)
    with contextlib.nullcontext() if bound == "native" else without_blocked_linear(torch.bfloat16):
        assert packed.model.pack_for_cpu() and not packed.model.pack_for_cpu()
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.model.modules())
    native = bound == "native" and ops.blocked_linear_available(torch.bfloat16)
    dual = ops.small_linear_available() and bound == "default"
    for layer in (packed.model.layers[0].self_attn.qkv_proj, packed.model.packed_head):
        assert isinstance(layer, NativeLinear if native else DualLayoutLinear if dual else PackedLinear)
    ids = list(range(40, 60))
    out = []
    for lm in (plain, packed):
        caches = allocate_kv_cache(lm.config, 8, 8, dtype=torch.bfloat16)
        steps = [(18, 0), (19, 18), (20, 18)]  # (tokens so far, of which cached)
        out.append(torch.cat([run_logits(lm.model, caches, [(ids[:n], [3, 1, 6], c)], 8)[0] for n, c in steps]).float())
    assert (out[0] - out[1]).abs().max() < 0.03 * out[0].abs().max()


def test_a_second_layout_is_kept_where_memory_allows(monkeypatch):
    """Up to DUAL_LAYOUT_MAX_BYTES of layer weights anywhere; more only for the native decode
    kernel and where the second copy takes at most a third of the memory still available; never
    where that is unknown."""
    from prefixkv.model import llama

    gib = 1 << 30
    monkeypatch.setattr(llama, "memory_available_bytes", lambda: 12 * gib)
    assert llama.keeps_two_layouts(2 * gib, True) and llama.keeps_two_layouts(4 * gib, True)
    assert not llama.keeps_two_layouts(4 * gib + 1, True)
    assert llama.keeps_two_layouts(2 * gib, False) and not llama.keeps_two_layouts(2 * gib + 1, False)
    monkeypatch.setattr(llama, "memory_available_bytes", lambda: None)
    assert llama.keeps_two_layouts(2 * gib, True) and not llama.keeps_two_layouts(2 * gib + 1, True)
    monkeypatch.undo()
    available = llama.memory_available_bytes()
    assert available is None or available > 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases go through both kernels
# tolerated-*: the many-row native linear timed within the tolerance but slower than oneDNN
@pytest.mark.parametrize("bound", ["native", "default", "exceeded", "tolerated-default", "tolerated-exceeded"])
@pytest.mark.usefixtures("every_native_kernel")  # "native": the many-row linear
def test_fp32_laid_out_weights_match_plain_fp32(tmp_path, monkeypatch, kind, bound):
    """ModelRunner lays float32 CPU weights out once for the native kernels where the many-row one
    was chosen ("native": NativeLinear); else twice (DualLayoutLinear: plain for 1-2 rows,
    oneDNN-packed for more) or, past the size bound, oneDNN-packed alone: logits equal plain
    F.linear's up to float32 rounding, the same greedy tokens, and doing it twice is a no-op. The
    steps of 18, 1 and 2 new tokens go through both kernels of either two-kernel layer."""
    from prefixkv.model import llama

    tolerated = bound.startswith("tolerated-")
    bound = bound.removeprefix("tolerated-")
    if bound == "exceeded":
        monkeypatch.setattr(llama, "DUAL_LAYOUT_MAX_BYTES", 1024)
        monkeypatch.setattr(llama, "DUAL_LAYOUT_MEMORY_SHARE", 0.0)
    path = tmp_path / f"tiny-{kind}.gguf"
    _write_gguf(path, kind)
    plain, fast = load_model(str(path)), load_model(str(path))
    blocked = ops.blocked_linear_available(torch.float32)
    layout = without_blocked_linear(torch.float32, tolerated=tolerated)
    with contextlib.nullcontext() if bound == "native" else layout:
        assert fast.model.pack_for_cpu() and not fast.model.pack_for_cpu()
    assert not any(isinstance(m, torch.nn.Linear) for m in fast.model.modules())
    native = blocked and (bound == "native" or (tolerated and bound == "exceeded"))
    dual = packed_linear_works(torch.float32) and bound != "exceeded"
    packed = packed_linear_works(torch.float32)
    single = PackedLinear if packed else TransposedLinear
    want = NativeLinear if native else DualLayoutLinear if dual else single
    assert isinstance(fast.model.layers[0].self_attn.qkv_proj, want)
    # the head: a second layout only for the native kernel (AVX-512), else oneDNN-packed alone
    native_head = dual and ops.small_linear_available(torch.float32)
    head = DualLayoutLinear if native_head else PackedLinear if packed_linear_works(torch.float32) else TransposedLinear
    assert isinstance(fast.model.packed_head, NativeLinear if native else head)
    # 1-2 rows: the native kernel where the CPU has it, else F.linear on the plain weight
    layer = fast.model.layers[0].self_attn.qkv_proj
    if want is DualLayoutLinear:
        assert (layer.small is not None) == ops.small_linear_available(torch.float32)
    ids = list(range(40, 60))
    out = []
    for lm in (plain, fast):
        caches = allocate_kv_cache(lm.config, 8, 8)
        # one prefill of 18 rows (packed kernel), then steps of 1 and 2 rows (plain kernel)
        steps = [(18, 0), (19, 18), (20, 18)]  # (tokens so far, of which cached)
        out.append(torch.cat([run_logits(lm.model, caches, [(ids[:n], [3, 1, 6], c)], 8)[0] for n, c in steps]))
    assert torch.allclose(out[0], out[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))


def test_the_suites_saved_reference_reads_as_the_gguf(tmp_path, monkeypatch):
    """tests/reference_copy.py, the suite's oracle kept per machine: the saved copy reloads with the
    parameters, outputs and tokenization transformers reads from the GGUF; the file is read once; a
    copy that does not reload as read is refused; another file gets a copy of its own."""
    pytest.importorskip("accelerate", reason="transformers needs `accelerate` to load a GGUF model")
    from .. import reference_copy

    monkeypatch.setenv("PREFIXKV_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tiny-llama.gguf")
    _write_gguf(path, "llama")
    fresh, fresh_tok = reference_copy.read_gguf(path)
    model, tok = reference_copy.reference_model(path), reference_copy.reference_tokenizer(path)
    want, got = fresh.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    text = "héllo wörld, 123"
    assert tok(text)["input_ids"] == fresh_tok(text)["input_ids"]

    def no_reading(_path):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(reference_copy, "read_gguf", no_reading)
    assert torch.equal(reference_copy.reference_model(path).lm_head.weight, fresh.lm_head.weight)

    with torch.no_grad():
        fresh.lm_head.weight[0, 0] += 1.0
    with pytest.raises(RuntimeError, match="does not reload"):
        reference_copy.check_copy(fresh, reference_copy.copy_folder(path))

    other = str(tmp_path / "tiny-qwen2.gguf")
    _write_gguf(other, "qwen2")
    with pytest.raises(AssertionError, match="read again"):
        reference_copy.copy_folder(other)
