"""`prefixkv serve`'s flags against EngineArgs (offline `LLM(...)` and `serve` take the same
options), `--config` YAML files, and the server flag combinations refused before a model loads.
Nothing here starts a server (tests/server/test_serve_flags.py does)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from prefixkv import cli
from prefixkv.engine_args import EngineArgs
from prefixkv.replicas.args import ROUTER_FLAGS, serve_parser
from prefixkv.server.config_file import expand_config

# EngineArgs fields with no flag of their own name, and why
ENGINE_ONLY = {
    "model": "the positional MODEL (or --model, dest model_flag)",
    "num_blocks": "prefixkv's offline alias of num_gpu_blocks_override (--num-gpu-blocks-override)",
}
# serve flags that are not EngineArgs fields: the HTTP server's and the replicas'
SERVER_ONLY = {
    "model_tag": "the positional MODEL",
    "model_flag": "--model, the same as MODEL",
    "disable_log_stats": "EngineArgs.disable_log_stats; served by the server's stats line flag",
    "config": "--config FILE, expanded into flags before parsing",
    # the HTTP server (prefixkv/server/launch.py)
    **dict.fromkeys(
        [
            "host",
            "port",
            "api_key",
            "lora_modules",
            "allow_runtime_lora_updating",
            "lora_allowed_dir",
            "chat_template",
            "served_model_name",
            "require_cache_salt",
            "max_request_body_bytes",
            "max_n",
            "max_prompts_per_request",
            "shutdown_timeout",
            "enable_auto_tool_choice",
            "tool_call_parser",
            "uvicorn_log_level",
            "disable_uvicorn_access_log",
            "disable_log_requests",
            "enable_log_requests",
            "max_log_len",
            "enable_prompt_tokens_details",
            "response_role",
            "return_tokens_as_token_ids",
            "root_path",
            "allowed_origins",
            "allowed_methods",
            "allowed_headers",
            "allow_credentials",
            "ssl_keyfile",
            "ssl_certfile",
            "ssl_ca_certs",
            "ssl_cert_reqs",
        ],
        "the HTTP server's (the engine has no such option)",
    ),
    "replicas": "--replicas N (Ray Serve)",
    **dict.fromkeys(ROUTER_FLAGS, "the replicas' router (prefixkv/replicas/args.py)"),
}


def _serve_dests() -> set[str]:
    return {a.dest for a in serve_parser()._actions if a.dest != "help"}


def test_every_engine_option_is_a_serve_flag_and_every_serve_flag_is_known():
    dests = _serve_dests()
    engine = {f.name for f in fields(EngineArgs)}
    assert sorted(engine - dests - set(ENGINE_ONLY)) == []  # an LLM(...) option serve lacks
    assert sorted(dests - engine - set(SERVER_ONLY)) == []  # a serve flag neither list explains
    assert sorted(set(ENGINE_ONLY) & dests) == []  # the lists stay true
    assert sorted(set(SERVER_ONLY) - dests) == []


@pytest.mark.parametrize(
    "argv,field,value",
    [
        (["--download-dir", "/tmp/x"], "download_dir", "/tmp/x"),
        (["--load-format", "gguf"], "load_format", "gguf"),
        (["--tokenizer-mode", "auto"], "tokenizer_mode", "auto"),
        (["--runner", "pooling"], "runner", "pooling"),
        (["--task", "embed"], "task", "embed"),
        (["--hf-overrides", "{}"], "hf_overrides", {}),
        (["--compilation-config", "3"], "compilation_config", 3),
        (["--compilation-config", '{"level": 3}'], "compilation_config", {"level": 3}),
        (["--disable-custom-all-reduce"], "disable_custom_all_reduce", True),
    ],
)
def test_vllm_flags_map_to_engine_args(argv, field, value):
    args = serve_parser().parse_args(argv)
    assert getattr(cli.engine_config(args), field) == value


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tokenizer-mode", "slow"], "tokenizer_mode='slow' is not supported"),
        (["--load-format", "safetensors"], "load_format='safetensors' does not match"),
        (["--runner", "draft"], "runner='draft' is not supported"),
        (["--hf-overrides", '{"rope_theta": 1}'], "hf_overrides="),
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method='eagle'"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
    ],
)
def test_vllm_flags_that_would_change_output_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        cli.engine_config(serve_parser().parse_args(argv))


def test_load_format_names_what_the_model_has(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    assert EngineArgs(model=str(folder), load_format="safetensors").load_format == "safetensors"
    with pytest.raises(ValueError, match="its weights are safetensors"):
        EngineArgs(model=str(folder), load_format="gguf")
    with pytest.raises(ValueError, match="its weights are safetensors"):
        EngineArgs(model=str(folder), load_format="pt")  # the loader would read the safetensors
    with pytest.raises(ValueError, match="load_format='bitsandbytes' is not supported"):
        EngineArgs(load_format="bitsandbytes")
    assert EngineArgs(load_format="gguf").load_format == "gguf"  # the embedded model


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_flags_and_command_line_overrides(tmp_path):
    path = _yaml(
        tmp_path,
        "max-model-len: 512\n"
        "block_size: 32\n"
        "enable-prefix-caching: false\n"
        "api-key: [k1, k2]\n"
        "served-model-name: [a, b]\n"
        "allowed-origins: ['https://app.example']\n"
        "kv-events-config: {enable_kv_cache_events: true}\n"
        "disable-log-stats: true\n"
        "enable-log-requests: false\n"
        "port: 9000\n"
        "model: ./some-model\n",
    )
    argv = expand_config(["--config", path, "--port", "8001", "--no-enable-prefix-caching"], serve_parser())
    args = cli.build_parser().parse_args(["serve", *argv])
    assert (args.max_model_len, args.block_size, args.port) == (512, 32, 8001)
    assert args.enable_prefix_caching is False and args.disable_log_stats is True
    assert args.api_key == ["k1", "k2"] and args.served_model_name == ["a", "b"]
    assert args.allowed_origins == ["https://app.example"] and args.enable_log_requests is False
    assert args.kv_events_config == '{"enable_kv_cache_events": true}'
    assert args.model_flag == "./some-model"
    # a flag given on the command line replaces the file's, a repeatable one included
    argv = expand_config([f"--config={path}", "--api-key", "k3", "--max-model-len", "256"], serve_parser())
    args = cli.build_parser().parse_args(["serve", *argv])
    assert args.api_key == ["k3"] and args.max_model_len == 256


@pytest.mark.parametrize(
    "text,message",
    [
        ("max-modle-len: 512\n", "unknown key 'max-modle-len'"),
        ("- a\n- b\n", "must be a mapping"),
        ("enable-prefix-caching: maybe\n", "takes true or false"),
        ("config: other.yaml\n", "cannot name another one"),
        ("a: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_files_are_refused_by_name(tmp_path, capsys, text, message):
    assert cli.main(["serve", "--config", _yaml(tmp_path, text)]) == 2
    assert message in capsys.readouterr().err


def test_config_file_values_are_checked_as_flags(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--config", _yaml(tmp_path, "max-model-len: many\n")])
    assert "--max-model-len" in capsys.readouterr().err
    assert cli.main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the --config file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-log-len", "10"], "--max-log-len needs --enable-log-requests"),
        (["--allow-credentials"], "--allow-credentials needs --allowed-origins"),
        (["--allowed-methods", '["GET"]'], "--allowed-methods needs --allowed-origins"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs"),
        (["--root-path", "llm"], "--root-path must start with '/'"),
    ],
)
def test_server_flags_that_would_do_nothing_are_refused(argv, message):
    """Refused before the model loads (check_server_args runs first)."""
    with pytest.raises(SystemExit, match=message):
        cli.main(["serve", *argv])


def test_cors_flags_parse_json_lists():
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--allowed-origins", "https://a.example"])  # not JSON
    args = serve_parser().parse_args(["--allowed-origins", '["https://a.example"]'])
    assert args.allowed_origins == ["https://a.example"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
        ["--root-path", "/llm"],
        ["--allowed-origins", '["*"]'],
    ],
)
def test_http_flags_the_replicated_endpoint_cannot_honour_are_refused(argv):
    from prefixkv.replicas.args import check_replica_args

    with pytest.raises(ValueError, match="with --replicas"):
        check_replica_args(serve_parser().parse_args(["--replicas", "2", *argv]))
