"""The `prefixkv` command: serve an OpenAI-compatible API, or generate / chat in a terminal.

prefixkv serve [MODEL] [--port 8000] ...      OpenAI-compatible server, vLLM's flag names
prefixkv generate "PROMPT" [--max-tokens 64]  one completion (prompt argument or stdin)
prefixkv chat                                 interactive chat keeping history (/exit to quit)
prefixkv replay ...                           replay a request trace through the KV cache manager
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .engine_args import MODEL_HELP, EngineArgs, parse_bytes  # noqa: F401  (parse_bytes: part of this CLI's API)
from .replicas.args import add_serve_args, check_replica_args, check_single_engine_args


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens_default: int | None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens_default,
        help=f"most tokens to generate (default: {max_tokens_default or 'the rest of the context'})",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--cache-salt", default=None, help="isolate this request's prefix cache entries")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixkv",
        description="prefixkv: an LLM inference engine with exact automatic prefix caching. "
        "Serve an OpenAI-compatible API with vLLM's flags and metrics, or generate in a terminal.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  prefixkv serve --port 8000                  # embedded SmolLM2-135M-Instruct\n"
        "  prefixkv serve ~/models/SmolLM2-135M --api-key sk-local --served-model-name smol\n"
        "  prefixkv generate 'The capital of France is' --max-tokens 16\n"
        "  echo 'Tell me a joke' | prefixkv generate --stream\n"
        "  prefixkv chat --system 'You are terse.'\n"
        "run 'prefixkv COMMAND --help' for a command's flags.",
    )
    parser.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server (like `vllm serve`)",
        description="Run an OpenAI-compatible HTTP server: POST /v1/completions, /v1/chat/completions, "
        "GET /v1/models, /health, /metrics (Prometheus, vLLM's metric names), "
        "POST /reset_prefix_cache. Flags follow `vllm serve`.",
    )
    add_serve_args(serve)  # --replicas N >= 2: Ray Serve (prefixkv/replicas/, imported only then)

    gen = sub.add_parser(
        "generate",
        help="generate one completion in the terminal",
        description="Complete one prompt (argument, or stdin when omitted) and print the text.",
    )
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text; read from stdin when omitted")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("-n", type=int, default=1, help="completions to sample (default: 1)")
    EngineArgs.add_cli_args(gen, positional_model=False)
    _add_sampling_args(gen, 64)

    chat = sub.add_parser(
        "chat",
        help="interactive chat in the terminal (keeps history; /exit to quit)",
        description="Chat with the model, one line per turn read from stdin. "
        "Commands: /exit (or EOF) quits, /reset clears the history.",
    )
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--no-stream", dest="stream", action="store_false", help="print each reply when complete")
    EngineArgs.add_cli_args(chat, positional_model=False)
    _add_sampling_args(chat, 256)

    kernels = sub.add_parser(
        "kernels",
        help="which native CPU kernels run here, and why (timed against PyTorch on the model's shapes)",
        description="Build the native CPU kernels if need be, then print the CPU, the build and, per "
        "kernel, its time against the PyTorch path on the model's shapes and which one runs "
        "(measured once per machine and kept; --remeasure times again).",
    )
    kernels.add_argument("model", nargs="?", default=None, help="HF folder or .gguf (default: the embedded model)")
    kernels.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    kernels.add_argument("--remeasure", action="store_true", help="time again even where an answer is kept")

    sub.add_parser(
        "replay",
        help="replay a request trace through the KV cache manager (see docs/replay.md)",
        add_help=False,
        description="run 'prefixkv replay --help' for its flags",
    )
    return parser


def cmd_kernels(args: argparse.Namespace) -> int:
    """Print which native CPU kernels run for a model here and the timings that chose them."""
    import os

    import torch

    from .model import loader
    from .model.config import ModelConfig
    from .model.kernels import build, ops
    from .model.kernels import choice as kernel_choice

    if args.remeasure:
        os.environ[kernel_choice.ENV_MODE] = "measure"
    path = os.path.expanduser(args.model) if args.model else loader.default_model_path()
    if os.path.isdir(path):
        config = ModelConfig.from_hf_folder(path)
    else:  # a GGUF: its header only, no weights
        config = loader.gguf_config(loader._open_gguf(path))
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {build.cpu_model() or 'unknown'}; build target {build.arch()}")
    if not ops.available():
        print("native CPU kernels: not available here (see the log line above); the PyTorch path runs")
        return 0
    print(f"library: {ops.library_name()}")
    shapes = kernel_choice.KernelShapes.of(config, dtype)
    for line in kernel_choice.describe(shapes):
        print(f"  {line}")
    made = ops.choice(dtype)
    if made is not None:
        print(kernel_choice.summary(made))
    return 0


def engine_config(args: argparse.Namespace) -> EngineArgs:
    """The parsed flags as EngineArgs (refuses vLLM options prefixkv does not implement)."""
    return EngineArgs.from_cli_args(args)


def sampling_params(args: argparse.Namespace, n: int = 1):
    from .sampling_params import SamplingParams

    return SamplingParams(
        n=n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        max_tokens=args.max_tokens,
    )


def _load_engine(args: argparse.Namespace):
    from .engine.llm_engine import LLMEngine
    from .progress import show_info_logs

    show_info_logs()  # the start's stages on stderr: a first start (kernels, weights) is never silent

    return LLMEngine(engine_config(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.launch import PortInUse, bind_socket, check_server_args, run_server

    # flags refused before Ray, torch and the model are imported: a mistake costs no start-up
    check_server_args(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.replicas != 1:
        try:
            check_replica_args(args)  # 0 and below among them
        except ValueError as e:
            print(f"prefixkv serve: {e}", file=sys.stderr)
            return 2
        from .replicas.app import serve_replicas  # imports Ray

        return serve_replicas(args)
    check_single_engine_args(args)
    from .engine.llm_engine import LLMEngine
    from .server.app import DEFAULT_MODEL_NAME

    log = logging.getLogger("prefixkv.server")
    config = engine_config(args)
    try:
        sock = bind_socket(args.host, args.port)  # before the load: a port in use fails at once
    except PortInUse as e:
        print(f"prefixkv serve: {e}", file=sys.stderr)
        return 1
    log.info("loading %s", config.model or "the embedded SmolLM2-135M-Instruct")
    engine = LLMEngine(config)
    log.info(
        "max_model_len=%d, %d KV blocks of %d tokens, prefix caching %s",
        engine.max_model_len,
        engine.num_blocks,
        config.block_size,
        "on" if config.enable_prefix_caching else "off",
    )
    return run_server(args, engine, config.model or DEFAULT_MODEL_NAME, sock)


def _run_stream(
    engine, prompt_ids: list[int], params, cache_salt: str | None, out=None, stream: bool = True
) -> list[str]:
    """Drive the engine for one request, printing text as it grows; returns the final texts."""
    out = out or sys.stdout
    rid = engine.add_request(prompt_ids, params, cache_salt=cache_salt)
    printed = 0
    final = None
    try:
        while final is None:
            for o in engine.step():
                if o.request_id != rid:
                    continue
                if stream and params.n == 1:
                    text = o.outputs[0].text
                    out.write(text[printed:])
                    out.flush()
                    printed = len(text)
                if o.finished:
                    final = o
    except BaseException:
        engine.abort_request(rid)
        raise
    texts = [c.text for c in final.outputs]
    if stream and params.n == 1:
        out.write("\n")
    return texts


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("prefixkv generate: empty prompt (pass it as an argument or on stdin)", file=sys.stderr)
        return 2
    try:
        params = sampling_params(args, n=args.n)
    except ValueError as e:
        print(f"prefixkv generate: {e}", file=sys.stderr)
        return 2
    engine = _load_engine(args)
    tok = engine.tokenizer
    if args.chat:
        ids = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
    else:
        ids = engine.tokenize(prompt)
    if params.max_tokens is not None and len(ids) + params.max_tokens > engine.max_model_len:
        params = params.clone(max_tokens=max(1, engine.max_model_len - len(ids)))
    try:
        texts = _run_stream(engine, ids, params, args.cache_salt, stream=args.stream)
    except ValueError as e:
        print(f"prefixkv generate: {e}", file=sys.stderr)
        return 2
    if not args.stream or params.n > 1:
        for i, t in enumerate(texts):
            if params.n > 1:
                print(f"--- {i}")
            print(t)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    try:
        params = sampling_params(args)
    except ValueError as e:
        print(f"prefixkv chat: {e}", file=sys.stderr)
        return 2
    engine = _load_engine(args)
    tok = engine.tokenizer
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    if interactive:
        print("prefixkv chat: type a message; /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode(
            tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        room = engine.max_model_len - len(ids)
        if room < 1:
            print("prefixkv chat: the conversation no longer fits the context; /reset to start over", file=sys.stderr)
            history.pop()
            continue
        p = params.clone(max_tokens=min(params.max_tokens or room, room))
        text = _run_stream(engine, ids, p, args.cache_salt, stream=args.stream)[0]
        if not args.stream:
            print(text)
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_replay(argv: Sequence[str]) -> int:
    try:
        from .replay import cli as replay_cli  # lazy: owned by the replay package
    except ImportError as e:
        print(f"prefixkv replay is not available: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(
        prog="prefixkv replay", description="Replay a request trace through the KV cache manager."
    )
    replay_cli.add_arguments(parser)
    return int(replay_cli.run(parser.parse_args(list(argv))) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        return cmd_replay(argv[1:])
    parser = build_parser()
    if argv and argv[0] == "serve":
        from .replicas.args import serve_parser
        from .server.config_file import ConfigFileError, expand_config

        try:
            argv = ["serve", *expand_config(argv[1:], serve_parser())]
        except ConfigFileError as e:
            print(f"prefixkv serve: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(f"prefixkv {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "kernels": cmd_kernels}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError) as e:
        print(f"prefixkv {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
