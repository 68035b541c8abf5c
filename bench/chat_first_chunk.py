"""When does a streamed chat response's first chunk arrive? Starts `prefixkv serve` from this
checkout, streams chat requests with long unique prompts (no cache hits) and prints the median time
to the first SSE chunk (the assistant role) and to the first content. vLLM sends the role chunk
once the first token exists; a server that sends it at once makes `vllm bench serve
--backend openai-chat` report a TTFT that skips the prefill. Both medians should be equal."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "river mountain quiet engine paper lantern violet harbor copper signal garden winter orbit marble".split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--words", type=int, default=650, help="prompt length in words (~1.3 tokens each)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port), "--max-model-len", "1024"]
    cmd += ["--kv-cache-memory-bytes", "128M", "--disable-uvicorn-access-log", "--disable-log-stats"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit("the server exited")
            time.sleep(0.3)
        first_chunk, first_content = [], []
        for i in range(args.requests):
            rng = random.Random(i)
            prompt = " ".join(rng.choice(WORDS) for _ in range(args.words))
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True}
            t0 = time.perf_counter()
            chunk = content = None
            with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    chunk = chunk if chunk is not None else time.perf_counter() - t0
                    if content is None and d["choices"] and d["choices"][0]["delta"].get("content"):
                        content = time.perf_counter() - t0
            first_chunk.append(chunk)
            first_content.append(content)
        print(
            f"{args.requests} chat streams, ~{args.words} words each: first chunk median "
            f"{statistics.median(first_chunk) * 1000:.1f} ms, first content median "
            f"{statistics.median(first_content) * 1000:.1f} ms"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
