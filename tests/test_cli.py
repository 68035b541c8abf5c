"""The `prefixkv` command line: help, flag names, generate and chat (model loaded once)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from prefixkv import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_SERVE_FLAGS = [
    "--host",
    "--port",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--block-size",
    "--prefix-caching-hash-algo",
    "--kv-cache-memory-bytes",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-model-len",
    "--dtype",
    "--api-key",
    "--served-model-name",
]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefixkv.cli", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_top_level_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("serve", "generate", "chat", "replay"):
        assert cmd in r.stdout
    assert run_cli().returncode == 2  # no command: help on stdout, usage error


def test_flags_are_read_and_refused_without_importing_torch():
    """`prefixkv --help`, every command's flags and a refused `serve` flag answer without importing
    torch (2-4 s of CPU a process): the package and its feature packages import it on first use."""
    check = (
        "import sys\n"
        "from prefixkv import cli\n"
        "parser = cli.build_parser()\n"
        "for command in ('serve', 'generate', 'chat'):\n"
        "    parser.parse_args([command])\n"
        "code = cli.main(['serve', '--replicas', '0'])\n"
        "assert code == 2, code\n"
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('prefixkv')]\n"
    )
    done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--replicas must be >= 1" in done.stderr


def test_serve_help_has_vllm_flags():
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    for flag in VLLM_SERVE_FLAGS:
        assert flag in r.stdout, flag
    assert "127.0.0.1" in r.stdout


def test_serve_args_map_to_engine_config():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "/models/x",
            "--no-enable-prefix-caching",
            "--block-size",
            "32",
            "--kv-cache-memory-bytes",
            "256M",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--max-model-len",
            "900",
            "--dtype",
            "float32",
            "--prefix-caching-hash-algo",
            "xxhash_cbor",
            "--api-key",
            "k",
            "--served-model-name",
            "a",
            "b",
        ]
    )
    cfg = cli.engine_config(args)
    assert (cfg.model, cfg.enable_prefix_caching, cfg.block_size, cfg.kv_cache_memory_bytes) == (
        "/models/x",
        False,
        32,
        256 << 20,
    )
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.dtype) == (8, 512, 900, "float32")
    assert cfg.prefix_caching_hash_algo == "xxhash_cbor"
    assert args.api_key == ["k"] and args.served_model_name == ["a", "b"] and args.host == "127.0.0.1"
    default = cli.build_parser().parse_args(["serve"])
    assert cli.engine_config(default).model is None and default.port == 8000
    assert cli.engine_config(default).enable_prefix_caching is True


def test_engine_flags_come_from_engine_args():
    from prefixkv.cache import POLICIES
    from prefixkv.engine_args import EngineArgs

    args = cli.build_parser().parse_args(["generate", "x", "--eviction-policy", "lfu", "--max-logprobs", "7"])
    cfg = cli.engine_config(args)
    assert isinstance(cfg, EngineArgs) and (cfg.eviction_policy, cfg.max_logprobs) == ("lfu", 7)
    assert cli.engine_config(cli.build_parser().parse_args(["chat"])) == EngineArgs()
    r = run_cli("serve", "--help")
    assert "--eviction-policy" in r.stdout and all(name in r.stdout for name in POLICIES)


def test_unimplemented_vllm_flags_are_refused_by_name(capsys):
    assert cli.main(["generate", "x", "--tensor-parallel-size", "2"]) == 1
    assert "tensor_parallel_size=2 is not supported" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--no-enable-chunked-prefill"]) == 1
    assert "enable_chunked_prefill" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("1024", 1024), ("512M", 512 << 20), ("2GiB", 2 << 30), ("1.5k", 1536)])
def test_parse_bytes(text, value):
    assert cli.parse_bytes(text) == value


def test_replay_is_wired_lazily():
    r = run_cli("replay", "--help")
    if r.returncode == 0:
        assert "usage: prefixkv replay" in r.stdout
    else:
        assert r.returncode == 2 and "not available" in r.stderr


@pytest.fixture(scope="module")
def engine():
    from prefixkv.config import EngineConfig
    from prefixkv.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(kv_cache_memory_bytes=64 << 20, max_model_len=1024))


@pytest.fixture
def shared_engine(engine, monkeypatch):
    monkeypatch.setattr(cli, "_load_engine", lambda args: engine)
    return engine


def _reference(engine, ids, max_tokens):
    from prefixkv.sampling_params import SamplingParams

    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    while True:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o.outputs[0].text


def test_generate_prints_greedy_text(shared_engine, capsys, monkeypatch):
    assert cli.main(["generate", "The capital of France is", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    expected = _reference(shared_engine, shared_engine.tokenize("The capital of France is"), 6)
    assert out == expected + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is"))
    assert cli.main(["generate", "--stream", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert shared_engine.kv_cache_usage == 0


def test_generate_rejects_bad_sampling(capsys):
    assert cli.main(["generate", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_chat_keeps_history(shared_engine, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nWhat did I just say?\n/exit\nnever read\n"))
    assert cli.main(["chat", "--max-tokens", "5", "--no-stream"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    tok = shared_engine.tokenizer
    first = _reference(
        shared_engine,
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False),
        5,
    )
    assert lines[0] == first
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "What did I just say?"},
    ]
    second = _reference(shared_engine, tok.encode(tok.apply_chat_template(history), add_special_tokens=False), 5)
    assert "\n".join(lines[1:]) == second.strip() or lines[1] == second.splitlines()[0]


def test_replay_runs_a_trace_with_every_policy_and_both_oracles(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000 * i, "prompt_token_ids": [i % 3] * 40 + [7] * (8 * (i % 4)) + [i], "output_length": 4}
        for i in range(30)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    r = run_cli(
        "replay",
        str(trace),
        "--block-size",
        "8",
        "--num-blocks",
        "12,64",
        "--policy",
        "all",
        "--optimum",
        "--reuse-oracle",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    from prefixkv.cache import POLICIES

    assert len(results) == 2 * (len(POLICIES) + 2)
    assert {x["policy"] for x in results} == {*POLICIES, "optimum", "reuse-oracle"}
    for x in results:
        assert x["requests"] == 30 and 0 <= x["fraction_of_optimum"] <= 1 + 1e-9
    assert max(x["hit_rate"] for x in results if x["num_blocks"] == 64) > 0.5
    bad = run_cli("replay", str(trace), "--policy", "nope")
    assert bad.returncode == 2 and "unknown eviction policy" in bad.stderr


def test_serve_exits_with_an_error_when_the_port_is_taken():
    """The address is bound before the model loads (as vLLM): a port in use ends the process
    (exit 1) with a clear message at once, never after a load nor serving nothing forever."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("serve", "--port", str(port), "--kv-cache-memory-bytes", "64M", "--max-model-len", "512")
    assert r.returncode == 1
    assert f"cannot bind 127.0.0.1:{port}" in r.stderr and "address already in use" in r.stderr.lower()
    assert "loading" not in r.stderr and "KV blocks" not in r.stderr  # it never got to the model
