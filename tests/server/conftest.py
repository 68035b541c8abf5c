"""A real `prefixkv serve` subprocess on a free 127.0.0.1 port, one per test module."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT = 180.0  # the model loads in ~8 s alone; allow for a busy machine


# One client for the tests' own requests: httpx.post/get/stream build a client per call, and a
# client's set-up (its TLS context) costs ~70 ms of CPU, more than most requests cost the server.
# No keep-alive: each request still opens a connection of its own, as with those calls. httpx's
# Client may be shared between threads.
HTTP_LIMITS = httpx.Limits(max_keepalive_connections=0)
HTTP = httpx.Client(limits=HTTP_LIMITS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str, env: dict[str, str] | None = None, scheme: str = "http", verify=True) -> None:
        """`scheme` https with `verify` (the CA file to trust): a server started with TLS flags."""
        self.args = extra  # the flags it was started with
        self.port = free_port()
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        self.verify = verify
        # a TLS server's client trusts its CA; a plain one shares the module's
        self.http = HTTP if verify is True else httpx.Client(verify=verify, limits=HTTP_LIMITS)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="prefixkv-serve-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "prefixkv.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-cache-memory-bytes",
            "128M",
            "--max-model-len",
            "1024",
            "--disable-uvicorn-access-log",
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        deadline = time.time() + STARTUP_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.http.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT}s:\n{self.output()}")
            time.sleep(0.3)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.http is not HTTP:
            self.http.close()
        self.log.close()
        os.unlink(self.log.name)

    # -- helpers -------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """vllm:/prefixkv: samples by name (labels dropped; summed over label sets)."""
        text = self.http.get(self.base + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def healthy(self) -> bool:
        return self.http.get(self.base + "/health", timeout=10).status_code == 200

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV usage is back to 0."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            if (
                m["vllm:kv_cache_usage_perc"] == 0
                and m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0
            ):
                return m
            if time.time() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {m}")
            time.sleep(0.1)


# The API server test_api.py and test_surface.py share (one start-up for both): two API keys,
# two served names, dev mode (POST /reset_prefix_cache) and a fast periodic stats line.
API_KEY = "test-key-123"
API_KEY2 = "second-key"
API_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def api_server():
    s = Server(
        "--api-key",
        API_KEY,
        "--api-key",
        API_KEY2,
        "--served-model-name",
        API_NAME,
        "smol",
        env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "0.5"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def make_server():
    servers: list[Server] = []

    def make(*extra: str, env: dict[str, str] | None = None) -> Server:
        s = Server(*extra, env=env)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


def long_text(seed: int, words: int = 300) -> str:
    """Deterministic filler text, distinct per seed (about 1.3 tokens per word)."""
    import random

    rng = random.Random(seed)
    vocab = (
        "river mountain quiet engine paper lantern violet harbor copper signal garden winter "
        "orbit marble thunder canvas meadow silver anchor falcon ember willow summit prism"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(words))
