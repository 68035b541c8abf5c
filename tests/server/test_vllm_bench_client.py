"""vLLM's own benchmark client (`vllm bench serve`, from the vLLM peer venv) against a real
`prefixkv serve`: every request succeeds through the chat and the completions backends, with every
token it asked for.
Runs where the peer venv exists (bench/peers/README.md; `$VLLM_PYTHON` points elsewhere)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", str(ROOT / "peers" / "vllm" / "bin" / "python"))

pytestmark = [
    pytest.mark.slow(seconds=30),
    pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM peer venv at {VLLM_PYTHON}"),
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    from prefixkv import LLM

    folder = tmp_path_factory.mktemp("tokenizer")
    LLM(max_model_len=1024).get_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def server(make_server):  # one for both backends: each run ends with the server idle (checked)
    return make_server("--served-model-name", "smol")


@pytest.mark.parametrize(
    ("backend", "endpoint"), [("openai-chat", "/v1/chat/completions"), ("vllm", "/v1/completions")]
)
def test_vllm_bench_serve_runs_clean(server, tokenizer_folder, backend, endpoint):
    argv = [VLLM_PYTHON, str(ROOT / "bench" / "peers" / "vllm_bench_serve.py"), "--backend", backend]
    argv += ["--base-url", server.base, "--endpoint", endpoint, "--model", "smol", "--tokenizer", str(tokenizer_folder)]
    argv += ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "8"]
    argv += ["--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600).stdout
    assert re.search(r"Successful requests:\s+6\b", out), out[-3000:]
    assert re.search(r"Failed requests:\s+0\b", out), out[-3000:]
    assert re.search(r"Total generated tokens:\s+48\b", out), out[-3000:]
    server.wait_idle()
