"""lm-evaluation-harness (the real `lm_eval` from PyPI) scores `prefixkv serve` through
`--model local-completions`, and the scores equal its `--model hf` backend's on transformers'
float32 copy of the same GGUF: a log-likelihood task (echo + logprobs on the prompt) and a
generation task (generate_until), both few-shot, from local task configs (lm_eval_tasks/). The
log-likelihood task runs twice: as lm_eval 0.4.13 sends it (`max_tokens: 1`, the generated token
dropped by the harness) and with `max_tokens: 0` (the prompt alone, as older harnesses and other
scoring clients send it)."""

from __future__ import annotations

import os

import lm_eval
import pytest

from .conftest import ROOT

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASKS = ["prefixkv_mc", "prefixkv_qa"]
MODEL = "smol"


@pytest.fixture(scope="module")
def hf_folder(request, tmp_path_factory, hf_ref_model, default_gguf_path):
    """transformers' float32 copy of the default GGUF (bench/peers/make_peer_model.py), built once
    into pytest's cache folder (a temporary one with -p no:cacheprovider) from the session's
    reference model and tokenizer (read from the GGUF once per machine: tests/reference_copy.py):
    the hf backend's model and both backends' tokenizer."""
    cache = getattr(request.config, "cache", None)
    folder = str(cache.mkdir("smollm2-135m-hf") if cache else tmp_path_factory.mktemp("smollm2-135m-hf"))
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        from bench.peers.make_peer_model import build

        from ..reference_copy import reference_tokenizer

        build(folder, model=hf_ref_model, tokenizer=reference_tokenizer(default_gguf_path))
    return folder


def evaluate(model, model_args: dict | None = None, tasks: list[str] = TASKS) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=manager, batch_size=1, bootstrap_iters=0
    )
    assert out is not None
    return out


def prompt_only_scoring(**kwargs):
    """local-completions scoring as other clients (and older harnesses) do it: `max_tokens: 0`,
    so the response holds the prompt's logprobs and nothing after them."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class PromptOnly(LocalCompletionsAPI):
        def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kw):
            payload = super()._create_payload(messages, generate, gen_kwargs, seed, eos, **kw)
            return payload if generate else {**payload, "max_tokens": 0}

        @staticmethod
        def parse_logprobs(outputs, tokens=None, ctxlens=None, **kw):
            res = []
            outs = outputs if isinstance(outputs, list) else [outputs]
            choices = [c for out in outs for c in sorted(out["choices"], key=lambda c: c["index"])]
            for choice, prompt, ctxlen in zip(choices, tokens or [], ctxlens or [], strict=True):
                lp = choice["logprobs"]
                assert len(lp["tokens"]) == len(prompt)  # the prompt's tokens, nothing generated
                lps, tops = lp["token_logprobs"][ctxlen:], lp["top_logprobs"][ctxlen:]
                res.append((sum(lps), all(x == max(top.values()) for x, top in zip(lps, tops))))
            return res

    return PromptOnly(**kwargs)


@pytest.mark.slow(seconds=40)
def test_lm_eval_local_completions_equals_hf_backend(make_server, hf_folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    # each evaluation's environment report (torch's collect_env: a `pip list` process, ~1 CPU-s
    # apiece) is read by nothing here
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
    # the stage-output cache lets the scoring requests read the shared few-shot prefix back
    server = make_server("--served-model-name", MODEL, "--enable-stage-output-cache")
    client = {
        "model": MODEL,
        "base_url": server.base + "/v1/completions",
        "tokenizer": hf_folder,
        "tokenizer_backend": "huggingface",
        "num_concurrent": 1,
        "max_retries": 1,
    }
    served = evaluate("local-completions", client)  # lm_eval 0.4.13 scores with max_tokens 1
    prompt_only = evaluate(prompt_only_scoring(**client), tasks=["prefixkv_mc"])
    hits = server.metrics()["vllm:prefix_cache_hits_total"]
    assert server.wait_idle()["vllm:kv_cache_usage_perc"] == 0
    hf = evaluate("hf", {"pretrained": hf_folder, "dtype": "float32", "device": "cpu"})

    res, ref = served["results"], hf["results"]
    for got in (res, prompt_only["results"]):
        assert got["prefixkv_mc"]["acc,none"] == ref["prefixkv_mc"]["acc,none"]
        assert got["prefixkv_mc"]["acc_norm,none"] == ref["prefixkv_mc"]["acc_norm,none"]
    assert res["prefixkv_qa"]["exact_match,strip"] == ref["prefixkv_qa"]["exact_match,strip"]
    assert ref["prefixkv_mc"]["acc,none"] > 0.5 and ref["prefixkv_qa"]["exact_match,strip"] > 0  # a real signal
    # per item: the same log-likelihoods (float32 rounding apart) and the same generated answers
    mc, mc_ref = served["samples"]["prefixkv_mc"], hf["samples"]["prefixkv_mc"]
    assert len(mc) == len(mc_ref) == 10
    for got, again, want in zip(mc, prompt_only["samples"]["prefixkv_mc"], mc_ref):
        assert got["doc_id"] == again["doc_id"] == want["doc_id"]
        assert [r[0][0] for r in got["resps"]] == pytest.approx([r[0][0] for r in want["resps"]], abs=1e-3)
        assert [r[0][0] for r in again["resps"]] == pytest.approx([r[0][0] for r in want["resps"]], abs=1e-3)
    qa, qa_ref = served["samples"]["prefixkv_qa"], hf["samples"]["prefixkv_qa"]
    assert [s["filtered_resps"] for s in qa] == [s["filtered_resps"] for s in qa_ref]
    assert hits > 0  # few-shot prompts share their prefix: the natural workload of the cache
