"""The KV-cache groups of a hybrid model (prefixkv/memory/kv_groups.py): equal-size groups per layer
kind, shared K/V tensors, and the longest request a pool holds."""

import torch

from prefixkv.memory.block_tensors import BlockTensors, kv_cache_specs
from prefixkv.memory.kv_groups import plan_kv_groups
from prefixkv.model import ModelConfig

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def test_gemma3_pattern_groups_by_the_smaller_kind():
    """Gemma 3 1B's shape: 26 layers, every sixth full -> 4 full, 22 sliding: groups of 4."""
    cfg = ModelConfig.from_hf_dict(
        dict(
            COMMON,
            architectures=["Gemma3ForCausalLM"],
            num_hidden_layers=26,
            head_dim=16,
            sliding_window=512,
            sliding_window_pattern=6,
        )
    )
    groups = plan_kv_groups(cfg)
    assert groups is not None and groups.group_size == 4
    assert groups.layers[0] == (5, 11, 17, 23) and groups.windows == (None,) + (512,) * 6
    assert sorted(i for g in groups.layers for i in g) == list(range(26))  # each layer once
    assert len(groups.layers[-1]) == 2  # 22 = 5 x 4 + 2: the last group pads
    tensor = groups.layer_tensor(26)
    assert [tensor[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3] and tensor[0] == 0 and tensor[1] == 1
    # the K/V tensors: one per layer of a group, shared by every group
    specs = kv_cache_specs(cfg, 16, torch.float32, groups)
    assert len(specs) == 4
    every_layer = BlockTensors(kv_cache_specs(cfg, 16, torch.float32)).bytes_per_block
    assert BlockTensors(specs).bytes_per_block * 26 == every_layer * 4


def test_qwen2_max_window_layers_splits_the_larger_kind():
    cfg = ModelConfig.from_hf_dict(
        dict(
            COMMON,
            architectures=["Qwen2ForCausalLM"],
            num_hidden_layers=28,
            use_sliding_window=True,
            sliding_window=4096,
            max_window_layers=21,
        )
    )
    groups = plan_kv_groups(cfg)
    assert groups is not None and groups.group_size == 7
    assert groups.windows == (None, None, None, 4096)
    assert groups.layers[3] == tuple(range(21, 28))


def test_one_kind_of_layer_is_one_group():
    mistral = ModelConfig.from_hf_dict(
        dict(COMMON, architectures=["MistralForCausalLM"], num_hidden_layers=4, sliding_window=64)
    )
    llama = ModelConfig.from_hf_dict(dict(COMMON, architectures=["LlamaForCausalLM"], num_hidden_layers=4))
    assert plan_kv_groups(mistral) is None and plan_kv_groups(llama) is None


def test_the_longest_request_counts_every_groups_blocks():
    cfg = ModelConfig.from_hf_dict(
        dict(COMMON, model_type="gemma2", num_hidden_layers=4, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
    )
    groups = plan_kv_groups(cfg)
    assert groups is not None and groups.windows == (None, 64)
    # 1,000 tokens in chunks of 256 with blocks of 16: 63 full-attention blocks, and the window
    # before a chunk plus the chunk, 63 + 256 -> 21 blocks, in the sliding group
    assert groups.blocks_for(1000, 256, 16) == 63 + (63 + 256) // 16 + 2
    assert groups.blocks_for(40, 256, 16) == 3 + 3  # shorter than the window: every block
    n = groups.max_tokens(100, 256, 16)
    assert groups.blocks_for(n, 256, 16) <= 100 < groups.blocks_for(n + 16, 256, 16)
