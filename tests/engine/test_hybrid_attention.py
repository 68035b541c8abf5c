"""Sliding-window and full-attention layers interleaved in one model (Gemma 2, Gemma 3 text,
Qwen2 with use_sliding_window + max_window_layers), as tiny random checkpoints built with
transformers' own classes: greedy outputs equal transformers' (eager attention, which applies
Gemma 2's soft-capping) with prompts longer than the window, with caching off and on, chunked
prefill and preemption; every KV block free after."""

from __future__ import annotations

import random

import pytest
import torch

from prefixkv import LLM, SamplingParams
from prefixkv.memory.kv_groups import plan_kv_groups
from prefixkv.model import ModelConfig, explicit_attention

from ..conftest import hf_greedy
from ..model.test_model_hf_folder import _common, _write_tokenizer
from .engine_oracle import assert_disk_tier_and_stage_outputs, replay_against_eager, serve_and_compare
from .test_correctness import check_prompt_logprobs, hf_prompt_logprobs

MAX_NEW = 8
WINDOW = 16


def _make(kind: str, **extra):
    import transformers as tf

    common = _common(max_position_embeddings=256, **extra)
    if kind == "gemma2":
        cfg = tf.Gemma2Config(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            # caps small enough to bite on these random weights
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        )
        cls = tf.Gemma2ForCausalLM
    elif kind == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
        cls = tf.Gemma3ForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            **{**common, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
        cls = tf.Qwen2ForCausalLM
    else:
        raise AssertionError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = cls(cfg).eval()
    gemma = kind.startswith("gemma")
    with torch.no_grad():  # norms around 1 (Gemma's weights hold w of 1 + w)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif kind == "gemma2" and ("q_proj" in name or "k_proj" in name):
                p.copy_(0.3 * torch.randn_like(p))  # scores large enough for the cap to bite
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen2"])
def test_hybrid_attention_matches_transformers(tmp_path, monkeypatch, kind):
    # Gemma 2's capped attention by query chunks shorter than the prompts and the prefill chunks
    monkeypatch.setattr(explicit_attention, "QUERY_CHUNK", 4)
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    types = hf.config.layer_types
    assert "sliding_attention" in types and "full_attention" in types
    cfg = ModelConfig.from_hf_folder(str(tmp_path))
    assert cfg.layer_types == types and cfg.sliding_window == WINDOW

    rng = random.Random(kind)
    shared = [rng.randrange(256) for _ in range(70)]  # > 4 windows
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    groups = plan_kv_groups(cfg)
    assert groups is not None and len(groups.windows) == (3 if kind == "qwen2" else 2)
    settings = [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=9),  # chunks after cached context, shorter than the window
        # too few for three: preemption, resumed from the cache (a block per group per position;
        # short chunks, so that several requests run and grow at once)
        dict(num_blocks=7 + 3 * (len(groups.windows) - 1), max_num_batched_tokens=16, max_model_len=112),
        dict(num_blocks=9, disable_hybrid_kv_cache_manager=True),  # every layer in one block
    ]
    for kwargs in settings:
        kwargs = {
            "dtype": "float32",
            "device": "cpu",
            "num_blocks": 64,
            "block_size": 16,
            "max_model_len": 128,
            **kwargs,
        }
        llm = serve_and_compare(tmp_path, prompts, params, expected, kwargs)
        engine = llm.llm_engine
        if kwargs["num_blocks"] < 64:
            assert engine.scheduler.num_preemptions > 0
        if kwargs.get("max_num_batched_tokens") == 9:  # every prompt position, in chunks: the final cap too
            scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
            for out in llm.generate(prompts[:2], scored, use_tqdm=False):
                check_prompt_logprobs(out, hf_prompt_logprobs(hf, out.prompt_token_ids), 1)
            assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_window_and_caps_change_the_output():
    """The oracle above can fail: without the window or the attention soft-cap transformers' own
    Gemma 2 predicts other tokens at many of these prompt positions, and without the final cap
    (monotonic: the same tokens) other logprobs."""
    rng = random.Random(1)
    prompt = torch.tensor([[rng.randrange(256) for _ in range(80)]])

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(prompt).logits[0], dim=-1)

    base = logits(_make("gemma2"))
    no_window = logits(_make("gemma2", layer_types=["full_attention"] * 2))
    no_cap = _make("gemma2")
    for layer in no_cap.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    no_final_cap = _make("gemma2")
    no_final_cap.config.final_logit_softcapping = None
    for other in (no_window, logits(no_cap)):
        assert (other.argmax(-1) != base.argmax(-1)).sum() > 10
    assert (logits(no_final_cap) - base).abs().max() > 0.1


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "vision-language Gemma 3"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ],
)
def test_refused_by_name(patch, message):
    d = _make("gemma3").config.to_dict()
    d.update(patch)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_lora_on_gemma_matches_peft(tmp_path, kind):
    """LoRA adapters wrap the same fused projections in Gemma's block: greedy tokens equal
    transformers + peft's, caching on."""
    from prefixkv.lora import LoRARequest

    from ..lora.conftest import ADAPTERS, peft_greedy, write_adapter

    base, adapter = tmp_path / "base", tmp_path / "all"
    base.mkdir()
    _make(kind).save_pretrained(base, safe_serialization=True)
    _write_tokenizer(base)
    write_adapter(base, adapter, seed=7, **ADAPTERS["all"])
    rng = random.Random(kind)
    shared = [rng.randrange(256) for _ in range(40)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 9))] for _ in range(2)]
    expected = peft_greedy(base, adapter, prompts, MAX_NEW)
    assert expected != peft_greedy(base, None, prompts, MAX_NEW)
    llm = LLM(str(base), dtype="float32", num_blocks=64, block_size=16, max_model_len=128, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    lora = LoRARequest("all", 1, str(adapter))
    for _ in range(2):  # the second time from the cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert llm.llm_engine.prefix_cache_stats.hits > 0
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def test_gemma_with_a_disk_tier_and_the_stage_output_cache(tmp_path):
    """The per-block features are model-agnostic: a new engine is served Gemma 3's blocks from a
    disk tier (same tokens), and pooled embeddings from the stage-output cache equal transformers'
    final hidden states."""
    assert_disk_tier_and_stage_outputs(tmp_path, _make("gemma3"), 16, MAX_NEW)


def test_hub_style_gemma_configs_are_read_as_transformers_reads_them():
    """config.json as transformers 4 wrote it for the released checkpoints (no layer_types, no
    rope_parameters): the per-layer kinds, windows and rotary bases transformers derives."""
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    gemma3 = ModelConfig.from_hf_dict(
        dict(
            common,
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=7,
            head_dim=16,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1_000_000,
            rope_local_base_freq=10_000,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            query_pre_attn_scalar=256,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
    )
    assert gemma3.layer_windows == [512] * 5 + [None, 512]
    assert (gemma3.rope_theta, gemma3.rope_local_theta) == (1_000_000, 10_000)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert gemma3.qk_norm and gemma3.tie_word_embeddings and gemma3.hidden_activation == "gelu_pytorch_tanh"
    gemma2 = ModelConfig.from_hf_dict(
        dict(common, model_type="gemma2", num_hidden_layers=4, sliding_window=4096, query_pre_attn_scalar=144)
    )
    assert gemma2.architecture == "Gemma2ForCausalLM" and gemma2.layer_windows == [4096, None, 4096, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.query_pre_attn_scalar == 144 and not gemma2.qk_norm


def test_kv_cache_groups_free_out_of_window_blocks_and_keep_every_output(tmp_path):
    """Gemma 3's pattern (five sliding layers to one full): a block holds one layer, the sliding
    groups keep only their window, so a long request holds a fraction of the memory it holds with
    every layer in one block - with the same tokens, cache hits included."""
    from prefixkv.kv_events.wire import event_to_wire, hash_converter

    hf = _make("gemma3", num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    assert hf.config.layer_types.count("full_attention") == 1
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(6)
    shared = [rng.randrange(256) for _ in range(160)]
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (5, 9)]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    held: dict[bool, int] = {}
    for grouped in (True, False):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            kv_cache_memory_bytes=2**20,
            block_size=16,
            max_model_len=256,
            enable_kv_cache_events=True,
            disable_hybrid_kv_cache_manager=not grouped,
        )
        engine = llm.llm_engine
        layers_per_block = 1 if grouped else 6
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[0]
        engine.add_request(prompts[1], params)  # 160 of its tokens from the cache
        engine.step()
        peak = 0
        while engine.has_unfinished_requests():
            blocks = engine.kv_cache_manager.num_blocks - engine.kv_cache_manager.num_free_blocks
            peak = max(peak, blocks * layers_per_block)
            for o in engine.step():
                if o.finished:
                    assert o.outputs[0].token_ids == expected[1] and o.num_cached_tokens == 160
        held[grouped] = peak
        assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks
        stored = [e for e in engine.take_kv_events() if type(e).__name__ == "BlockStored"]
        groups = {event_to_wire(e, hash_converter())["group_idx"] for e in stored}
        assert groups == ({0, 1, 2, 3, 4, 5} if grouped else {0})
    # 11 positions of 16 tokens: 11 x 6 layer-blocks in one group; with groups 11 for the full
    # layer and at most 3 for each sliding one (16-token window + the decode's block)
    assert held[False] == 11 * 6 and held[True] <= 11 + 5 * 3


@pytest.mark.slow(seconds=5)
@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "qwen2"])
def test_hybrid_decode_steps_replay_over_fixed_buffers(tmp_path, monkeypatch, kind):
    """Decode steps (and for Gemma 3 mixed steps: prompt chunks beside decodes, cudagraph_mode FULL)
    of a model mixing sliding and full layers, with KV-cache groups (a sliding group's blocks leave its window
    while the request runs), over the fixed buffers a CUDA graph replays - each later group its own
    slots and tables, Gemma 2's scores capped by Triton's kernels, scheduled ahead: greedy float32
    tokens equal transformers', each token's logprob the eager steps',
    caching on, every block free after. On a CPU uncaptured under Triton's interpreter, captured
    on a GPU."""
    from ..model.triton_interpreter import device, kernels_module

    kernels_module()
    monkeypatch.setenv("PREFIXKV_CUDA_GRAPHS", "static" if device().type == "cpu" else "capture")
    hf = _make(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    rng = random.Random(f"{kind}-graphs")
    shared = [rng.randrange(256) for _ in range(40)]  # > 2 windows
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    kwargs = dict(
        dtype="float32",
        device=str(device()),
        num_blocks=64,
        block_size=16,
        max_model_len=128,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    )
    if kind == "gemma3":  # mixed steps too (one kind: the interpreter's prefill kernel is slow)
        kwargs["max_num_batched_tokens"] = 16  # prompts in chunks, beside decodes: steps of 16 rows
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 16], "cudagraph_mode": "FULL"}
    engine = replay_against_eager(tmp_path, [prompts], expected, kwargs).llm_engine  # group tables carried ahead
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.replays > 0 and (kind != "gemma3" or graphs.mixed_replays > 0)
    assert len(graphs.group_inputs) == len(plan_kv_groups(engine.model_config).windows) - 1 > 0
    assert len(graphs.mixed_groups) == (len(graphs.group_inputs) if kind == "gemma3" else 0)
