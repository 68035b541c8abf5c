"""lm-evaluation-harness (the real `lm_eval` from PyPI) scores `prefixkv serve` through
`--model local-completions`, and the scores equal its `--model hf` backend's on transformers'
float32 copy of the same GGUF: a log-likelihood task (echo + logprobs on the prompt) and a
generation task (generate_until), both few-shot, from local task configs (lm_eval_tasks/)."""

from __future__ import annotations

import os

import lm_eval
import pytest

from .conftest import ROOT

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASKS = ["prefixkv_mc", "prefixkv_qa"]
MODEL = "smol"


@pytest.fixture(scope="module")
def hf_folder(request, tmp_path_factory):
    """transformers' float32 copy of the default GGUF (bench/peers/make_peer_model.py), built once
    into pytest's cache folder (a temporary one with -p no:cacheprovider): the hf backend's model
    and both backends' tokenizer."""
    cache = getattr(request.config, "cache", None)
    folder = str(cache.mkdir("smollm2-135m-hf") if cache else tmp_path_factory.mktemp("smollm2-135m-hf"))
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        from bench.peers.make_peer_model import build

        build(folder)
    return folder


def evaluate(model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=tasks, batch_size=1, bootstrap_iters=0
    )
    assert out is not None
    return out


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hf_backend(make_server, hf_folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    # the stage-output cache lets the scoring requests read the shared few-shot prefix back
    server = make_server("--served-model-name", MODEL, "--enable-stage-output-cache")
    served = evaluate(
        "local-completions",
        {
            "model": MODEL,
            "base_url": server.base + "/v1/completions",
            "tokenizer": hf_folder,
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            "max_retries": 1,
        },
    )
    hits = server.metrics()["vllm:prefix_cache_hits_total"]
    assert server.wait_idle()["vllm:kv_cache_usage_perc"] == 0
    hf = evaluate("hf", {"pretrained": hf_folder, "dtype": "float32", "device": "cpu"})

    res, ref = served["results"], hf["results"]
    assert res["prefixkv_mc"]["acc,none"] == ref["prefixkv_mc"]["acc,none"]
    assert res["prefixkv_mc"]["acc_norm,none"] == ref["prefixkv_mc"]["acc_norm,none"]
    assert res["prefixkv_qa"]["exact_match,strip"] == ref["prefixkv_qa"]["exact_match,strip"]
    assert ref["prefixkv_mc"]["acc,none"] > 0.5 and ref["prefixkv_qa"]["exact_match,strip"] > 0  # a real signal
    # per item: the same log-likelihoods (float32 rounding apart) and the same generated answers
    mc, mc_ref = served["samples"]["prefixkv_mc"], hf["samples"]["prefixkv_mc"]
    assert len(mc) == len(mc_ref) == 10
    for got, want in zip(mc, mc_ref):
        assert got["doc_id"] == want["doc_id"]
        assert [r[0][0] for r in got["resps"]] == pytest.approx([r[0][0] for r in want["resps"]], abs=1e-3)
    qa, qa_ref = served["samples"]["prefixkv_qa"], hf["samples"]["prefixkv_qa"]
    assert [s["filtered_resps"] for s in qa] == [s["filtered_resps"] for s in qa_ref]
    assert hits > 0  # few-shot prompts share their prefix: the natural workload of the cache
