"""Fixtures of the tier tests: a tiny random Llama written by transformers (fast to load, in this
process and in subprocesses), engines on it, and a real redis-server on a free local port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from prefixkv.engine.llm_engine import LLMEngine
from prefixkv.engine_args import EngineArgs
from prefixkv.sampling_params import SamplingParams

from ..model.test_model_hf_folder import _make, _write_tokenizer

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_tiny(folder, seed: int = 0) -> str:
    model = _make("llama", max_position_embeddings=1024)  # seeds its own weights (seed 0)
    if seed:  # another model of the same shape: other weights
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model):
    from prefixkv.model import load_model

    return load_model(tiny_model, dtype=torch.float32, device="cpu")


def engine(tiny_model, tiny_loaded, **kw) -> LLMEngine:
    args = dict(block_size=BLOCK, num_blocks=32, max_num_batched_tokens=256, dtype="float32", device="cpu")
    args.update(kw)
    return LLMEngine(EngineArgs(model=tiny_model, **args), loaded=tiny_loaded)


def run(eng: LLMEngine, prompt: list[int]):
    """One request to completion: (output tokens, cached tokens)."""
    rid = eng.add_request(prompt, GREEDY)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None and final.error is None, final
    return final.outputs[0].token_ids, final.num_cached_tokens


def all_free(eng: LLMEngine) -> bool:
    kv = eng.scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks


def tier(eng: LLMEngine, name: str):
    return next(t for t in eng.get_stats().kv_tiers if t.tier == name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server (Debian's package) on a free local port, no persistence."""

    def __init__(self, workdir, debug: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install -y redis-server (.ci/run does)")
        self.binary, self.workdir = binary, workdir
        # DEBUG SLEEP makes the server hang for a while: the tests' slow store (Redis >= 7 flag)
        self.extra = ["--enable-debug-command", "local"] if debug else []
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(self.workdir)]
            + self.extra,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
