"""Multimodal caching: time to first token and encoder calls for questions about images, with the
prefix cache on / off and the encoder cache on / off.

No vision weights can be downloaded here, so the model is a random LLaVA 1.5 written by
transformers (a CLIP ViT at 224 px / patch 16 -> 196 image tokens, 6 layers of width 384; a
4-layer Llama decoder of width 512): the timings are real, the answers are noise. Two workloads,
each request sent alone (so its TTFT is its own prefill):

- same image: `--questions` different questions about one image;
- image set:  `--images` images, questions round-robin over them.

TTFT is reported separately for requests whose image is new to the engine and for those whose
image was asked about before. Each question follows the image ("USER: <image>\\nquestion
ASSISTANT:"), and questions differ from their first word, so with the prefix cache the image's
blocks hit but the one holding the image's tail and the question is computed again - its image
rows come from the encoder cache, or from running the encoder again when it is off.

    .venv/bin/python bench/multimodal.py [--questions 12] [--images 4] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from PIL import Image, ImageDraw  # noqa: E402

from prefixkv import LLM, SamplingParams  # noqa: E402

CONFIGS = [
    ("prefix cache on,  encoder cache on ", dict(enable_prefix_caching=True, enable_mm_encoder_cache=True)),
    ("prefix cache on,  encoder cache off", dict(enable_prefix_caching=True, enable_mm_encoder_cache=False)),
    ("prefix cache off, encoder cache on ", dict(enable_prefix_caching=False, enable_mm_encoder_cache=True)),
    ("prefix cache off, encoder cache off", dict(enable_prefix_caching=False, enable_mm_encoder_cache=False)),
]


def picture(seed: int, size: int = 320) -> Image.Image:
    import random

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size * 3 // 4), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(size), rng.randrange(size * 3 // 4)
        w, h = rng.randrange(20, 120), rng.randrange(20, 120)
        draw.ellipse([x, y, x + w, y + h], fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def questions(n: int) -> list[str]:
    """Questions that differ from their first word: the block holding the image's tail differs too."""
    first = "What Which How Where Why Is Are Does Can Describe List Count Name Tell Compare Explain".split()
    return [f"{first[i % len(first)]} {i}: what about the shapes and colors in this image?" for i in range(n)]


def run(folder: str, kwargs: dict, work: list[tuple[str, int]], repeats: int) -> dict[str, float]:
    """Medians over requests whose image is new to the engine ("new") and whose image was asked
    about before ("seen"): wall-clock TTFT and this process's CPU time (steadier on a shared
    machine); and the encoder runs of one pass."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    wall: dict[str, list[float]] = {"new": [], "seen": []}
    cpu: dict[str, list[float]] = {"new": [], "seen": []}
    runs = 0
    for _ in range(repeats):
        llm = LLM(folder, device="cpu", dtype="float32", num_blocks=512, **kwargs)  # a fresh engine: empty caches
        llm.generate("warm up", params, use_tqdm=False)
        asked: set[int] = set()
        for q, image_id in work:
            prompt = {"prompt": f"USER: <image>\n{q} ASSISTANT:", "multi_modal_data": {"image": picture(image_id)}}
            kind = "seen" if image_id in asked else "new"
            t0, c0 = time.perf_counter(), time.process_time()
            llm.generate(prompt, params, use_tqdm=False)
            wall[kind].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
            asked.add(image_id)
        runs = llm.llm_engine.get_stats().mm_encoder_runs
    out = {f"{m}_{k}": statistics.median(v[k]) for m, v in (("wall", wall), ("cpu", cpu)) for k in ("new", "seen")}
    return {**out, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    import torch

    from tests.multimodal.llava_builder import build_llava

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        build_llava(
            folder,
            image_size=224,
            patch_size=16,
            vision_hidden=384,
            vision_layers=6,
            text_hidden=512,
            text_layers=4,
            text_intermediate=1536,
            max_position_embeddings=2048,
            randomize=False,
        )
        qs = questions(args.questions)
        workloads = {
            "same image": [(q, 0) for q in qs],
            f"{args.images} images": [(q, i % args.images) for i, q in enumerate(qs)],
        }
        print(
            f"{args.questions} questions, 1 token each, each request alone; {args.repeats} passes; medians; "
            f"{torch.get_num_threads()} torch threads"
        )
        print(
            f"{'workload':<12} {'configuration':<36} {'TTFT new image':>15} {'TTFT seen image':>16} "
            f"{'CPU new':>8} {'CPU seen':>9} {'encoder runs':>12}"
        )
        for name, work in workloads.items():
            for label, kwargs in CONFIGS:
                r = run(folder, kwargs, work, args.repeats)
                print(
                    f"{name:<12} {label:<36} {r['wall_new'] * 1e3:>12.0f} ms {r['wall_seen'] * 1e3:>13.0f} ms "
                    f"{r['cpu_new'] * 1e3:>5.0f} ms {r['cpu_seen'] * 1e3:>6.0f} ms {r['runs']:>12.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
