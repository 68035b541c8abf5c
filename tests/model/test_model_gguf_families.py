"""GGUF files of Gemma 2, Gemma 3 (text) and Mamba2, written from tiny random transformers
checkpoints by llama.cpp's converter rules (gguf_convert.py): the config read back as llama.cpp
reads it, greedy float32 tokens through the engine equal transformers' on the original checkpoint
with caching off and on, chunked and preempted, Q8_0 matrices dequantized close to the source, and what
the metadata says that prefixkv cannot honour refused by name."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import SamplingParams
from prefixkv.memory.kv_groups import plan_kv_groups
from prefixkv.model import load_model
from prefixkv.model.config import ModelConfig
from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.layer_kinds import FULL_ATTENTION, SLIDING_ATTENTION

from ..engine.engine_oracle import serve_and_compare
from .gguf_convert import write_gguf

VOCAB = 272  # a multiple of 16: the Mamba2 converter pads the token list to one
WINDOW = 16
MAX_NEW = 6


def make(kind: str):
    """A tiny random transformers model. Gemma's query_pre_attn_scalar is head_dim: llama.cpp
    writes none and uses head_dim (every size but 27B)."""
    import transformers as tf

    torch.manual_seed(0)
    common: dict = dict(vocab_size=VOCAB, bos_token_id=256, eos_token_id=257)
    if kind == "mamba2":
        cfg = tf.Mamba2Config(
            **common,
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            expand=2,
            state_size=16,
            n_groups=2,
            chunk_size=16,
            pad_token_id=257,
            architectures=["Mamba2ForCausalLM"],
        )
        m = tf.Mamba2ForCausalLM(cfg).eval()
        with torch.no_grad():  # an input-dependent state that matters, a norm weight that is not all ones
            for layer in m.backbone.layers:
                layer.mixer.in_proj.weight.normal_(0, 0.2)
                layer.mixer.out_proj.weight.normal_(0, 0.2)
                layer.mixer.norm.weight.normal_(1.0, 0.1)
        return m
    common.update(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
    )
    if kind == "gemma2":
        cfg = tf.Gemma2Config(**common, num_hidden_layers=2, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        cls = tf.Gemma2ForCausalLM
    else:  # six layers: llama.cpp's pattern, five sliding then one full
        cfg = tf.Gemma3TextConfig(
            **common,
            num_hidden_layers=6,
            final_logit_softcapping=3.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
        cls = tf.Gemma3ForCausalLM
    cfg.architectures = [cls.__name__]
    cfg._attn_implementation = "eager"
    m = cls(cfg).eval()
    with torch.no_grad():  # norms around 1 (the weights hold w of 1 + w); scores the caps bite on
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            elif kind == "gemma2" and ("q_proj" in name or "k_proj" in name):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return m


@torch.inference_mode()
def hf_tokens(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=257
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mamba2"])
def test_gguf_engine_matches_transformers(tmp_path, kind):
    hf = make(kind)
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, hf)
    config = load_model(str(path)).config
    if kind == "mamba2":
        assert config.is_recurrent and config.ssm_n_groups == 2 and config.head_dim == 32
    else:
        assert config.layer_types == hf.config.layer_types and config.sliding_window == WINDOW
        assert config.query_pre_attn_scalar == 16 and config.final_logit_softcapping == 3.0
    if kind == "gemma3":
        assert config.rope_theta == 100000.0 and config.rope_local_theta == 1000.0
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    rng = random.Random(kind)
    shared = [rng.randrange(256) for _ in range(40)]  # > 2 windows
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 10))] for _ in range(3)]
    expected = [hf_tokens(hf, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    settings: list[dict] = [
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=9),  # chunked, after cached context
        # two fit only with a shared prefix: preempted, resumed (every layer in one block; the KV-cache
        # groups' preemption: tests/engine/test_hybrid_attention.py)
        dict(num_blocks=8, max_model_len=64, disable_hybrid_kv_cache_manager=True),
    ]
    groups = plan_kv_groups(config)  # a block per group and position (memory/kv_groups.py)
    num_blocks = 48 * (len(groups.windows) if groups is not None else 1)
    for setting in settings:
        kwargs = {"dtype": "float32", "device": "cpu", "num_blocks": num_blocks, "block_size": 8, "max_model_len": 96}
        kwargs.update(setting)
        engine = serve_and_compare(path, prompts, params, expected, kwargs).llm_engine
        if kwargs["num_blocks"] == 8:
            assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["gemma3", "mamba2"])
def test_gguf_q8_0_matrices_close(tmp_path, kind):
    """Q8_0 matrices (norms, the conv kernel, A and D stay float32, as the converter keeps them)
    dequantize to the source weights; the float32 ones load exactly."""
    hf = make(kind)
    path = tmp_path / "q8.gguf"
    write_gguf(path, hf, quantize=True)
    types = {t.name: t.tensor_type.name for t in GGUFFile(str(path)).tensors}
    ours = load_model(str(path)).model
    if kind == "mamba2":
        assert types["blk.0.ssm_in.weight"] == "Q8_0" and types["blk.0.ssm_conv1d.weight"] == "F32"
        src, got = hf.backbone.layers[0].mixer, ours.layers[0].mixer
        pairs = [(src.in_proj.weight, got.in_proj.weight), (src.out_proj.weight, got.out_proj.weight)]
        assert torch.equal(src.conv1d.weight, got.conv1d.weight) and torch.equal(src.D, got.D)
        torch.testing.assert_close(got.A_log, src.A_log, rtol=1e-6, atol=1e-6)  # through -exp and log
    else:
        assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
        src_l, got_l = hf.model.layers[0], ours.layers[0]
        pairs = [(src_l.mlp.down_proj.weight, got_l.mlp.down_proj.weight)]
        assert torch.equal(got_l.post_feedforward_layernorm.weight, src_l.post_feedforward_layernorm.weight + 1)
    for src_w, got_w in pairs:
        assert (got_w - src_w).abs().max() < 0.01 * src_w.abs().max()


# ---------------------------------------------------------------------------------- metadata
def _gemma_meta(arch: str, **extra) -> dict:
    p = arch + "."
    return {
        "general.architecture": arch,
        p + "embedding_length": 64,
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "attention.key_length": 16,
        p + "block_count": 8,
        p + "feed_forward_length": 96,
        p + "vocab_size": VOCAB,
        p + "attention.layer_norm_rms_epsilon": 1e-6,
        **{p + k: v for k, v in extra.items()},
    }


GEMMA3_NAMES = {"blk.0.attn_q_norm.weight"}


def test_gemma_metadata_read_as_llama_cpp_reads_it():
    g2 = ModelConfig.from_gguf_metadata(_gemma_meta("gemma2"), set())
    assert g2.sliding_window == 4096 and g2.layer_types[:2] == [SLIDING_ATTENTION, FULL_ATTENTION]
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.rope_local_theta is None and g2.hidden_activation == "gelu_pytorch_tanh"
    g3 = ModelConfig.from_gguf_metadata(_gemma_meta("gemma3", **{"attention.sliding_window": 32}), GEMMA3_NAMES)
    assert g3.layer_types == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION] + [SLIDING_ATTENTION] * 2
    assert g3.rope_local_theta == 10000.0 and g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    assert g3.qk_norm and g3.query_pre_attn_scalar == 16  # head_dim: not a 27B layer count
    pattern = [True, False] * 4
    g3 = ModelConfig.from_gguf_metadata(
        _gemma_meta("gemma3", **{"attention.sliding_window": 32, "attention.sliding_window_pattern": pattern}),
        GEMMA3_NAMES,
    )
    assert g3.layer_types == [SLIDING_ATTENTION, FULL_ATTENTION] * 4
    g3 = ModelConfig.from_gguf_metadata(
        _gemma_meta("gemma3", **{"attention.sliding_window": 32, "attention.sliding_window_pattern": 0}), GEMMA3_NAMES
    )
    assert g3.layer_types == [SLIDING_ATTENTION] * 8  # llama.cpp's period 0
    g3 = ModelConfig.from_gguf_metadata(_gemma_meta("gemma3", **{"attention.sliding_window_pattern": 3}), GEMMA3_NAMES)
    assert not g3.any_sliding and g3.sliding_window is None  # no window: every layer full
    big = ModelConfig.from_gguf_metadata(
        {**_gemma_meta("gemma3", **{"attention.sliding_window": 32}), "gemma3.block_count": 62}, GEMMA3_NAMES
    )
    assert big.query_pre_attn_scalar == 16.0 and big.head_dim == 16  # 27B: hidden / heads (64 / 4)


@pytest.mark.parametrize(
    "meta, names, match",
    [
        (_gemma_meta("gemma3", attn_logit_softcapping=50.0), GEMMA3_NAMES, "attn_logit_softcapping"),
        (_gemma_meta("gemma3"), set(), "gemma3' without Q/K norms"),
        (_gemma_meta("gemma2"), {"blk.0.attn_q_norm.weight"}, "gemma2' with Q/K norms"),
        (_gemma_meta("gemma2"), {"blk.0.attn_q.bias"}, "attention biases"),
        (
            {k: v for k, v in _gemma_meta("gemma2").items() if "epsilon" not in k},
            set(),
            "gemma2.attention.layer_norm_rms_epsilon",
        ),
        (_gemma_meta("gemma2", **{"attention.value_length": 32}), set(), "value_length"),
        (_gemma_meta("gemma2", **{"rope.scaling.type": "longrope"}), set(), "rope scaling type 'longrope'"),
        (_gemma_meta("gemma2", **{"rope.dimension_count": 8}), set(), "partial rotary"),
    ],
)
def test_gemma_metadata_refused_by_name(meta, names, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta, names)


def _mamba_meta(**drop_or_set) -> dict:
    meta = {
        "general.architecture": "mamba2",
        "mamba2.embedding_length": 64,
        "mamba2.block_count": 2,
        "mamba2.vocab_size": VOCAB,
        "mamba2.ssm.inner_size": 128,
        "mamba2.ssm.state_size": 16,
        "mamba2.ssm.time_step_rank": 4,
        "mamba2.ssm.conv_kernel": 4,
        "mamba2.ssm.group_count": 2,
        "mamba2.attention.layer_norm_rms_epsilon": 1e-5,
    }
    for k, v in drop_or_set.items():
        if v is None:
            meta.pop("mamba2." + k.replace("__", "."))
        else:
            meta["mamba2." + k.replace("__", ".")] = v
    return meta


@pytest.mark.parametrize(
    "meta, match",
    [
        (_mamba_meta(ssm__group_count=None), "misses mamba2.ssm.group_count"),
        (_mamba_meta(attention__layer_norm_rms_epsilon=None), "misses mamba2.attention.layer_norm_rms_epsilon"),
        (_mamba_meta(ssm__time_step_rank=3), "not a multiple of mamba2.ssm.time_step_rank"),
        (_mamba_meta(ssm__group_count=3), "not a multiple of mamba2.ssm.group_count"),
    ],
)
def test_mamba2_metadata_refused_by_name(meta, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata(meta, set())


def test_mamba2_tensors_refused_by_name(tmp_path):
    """A tensor the model has no place for, and an A that is not -exp of anything."""
    import gguf

    hf = make("mamba2")
    path = tmp_path / "m.gguf"
    write_gguf(path, hf)
    cfg = ModelConfig.from_gguf_metadata(
        _mamba_meta(), {"blk.0.ssm_conv1d.bias", "blk.0.ssm_in.weight", "output.weight"}
    )
    assert cfg.ssm_use_conv_bias and not cfg.tie_word_embeddings and cfg.head_dim == 32
    with pytest.raises(ValueError, match="in/out projection biases"):
        ModelConfig.from_gguf_metadata(_mamba_meta(), {"blk.0.ssm_in.bias"})
    from prefixkv.model.loader import gguf_to_hf_name, mamba2_from_gguf

    with pytest.raises(ValueError, match="'blk.0.ssm_dt_norm.weight' in a mamba2 file"):
        gguf_to_hf_name("blk.0.ssm_dt_norm.weight", "mamba2")
    with pytest.raises(ValueError, match="every entry must be negative"):
        mamba2_from_gguf("blk.0.ssm_a", torch.tensor([[-1.0], [0.5]]).numpy())
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == "mamba2"


def test_gemma3_per_layer_pattern_read_from_a_file(tmp_path):
    """The per-layer form of the pattern (an array of booleans) as gguf-py writes it and GGUFFile reads it."""
    import gguf

    path = tmp_path / "pattern.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in _gemma_meta("gemma3", **{"attention.sliding_window": 32}).items():
        if key != "general.architecture":
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_sliding_window_pattern([False, True, True, False, True, True, True, False])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    config = ModelConfig.from_gguf_metadata(GGUFFile(str(path)).metadata, GEMMA3_NAMES)
    assert [t == SLIDING_ATTENTION for t in config.layer_types] == [False, True, True, False, True, True, True, False]
