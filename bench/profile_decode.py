"""Where a decode step's time goes: the default model's decode steps (prefixkv's paged model, and
transformers' beside it unless --no-hf) under cProfile (Python functions, by own time) and
torch.profiler (operators, by host time and by device time), after a warm-up.

    .venv/bin/python bench/profile_decode.py [--device cpu|cuda] [--dtype bfloat16] [--batch 1]
        [--context 256] [--steps 10] [--no-hf] [--no-cudnn-attention] [--top 25]

Written for the GPU: a decode step of a 135M-parameter model is a few hundred tiny kernels, so its
time is the host's - launches, syncs, Python - which these two tables show.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--no-cudnn-attention", action="store_true", help="CUDA: torch's cuDNN attention off (transformers' side)"
    )
    args = ap.parse_args()
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)

    from prefixkv.memory.block_tensors import allocate_kv_cache
    from prefixkv.model import AttentionMetadata, default_model_path, load_model

    dev, dtype = args.device, getattr(torch, args.dtype)
    lm = load_model(None, dtype=dtype, device=dev)
    model, cfg = lm.model, lm.config
    if dev == "cpu":
        model.pack_for_cpu()
    B, C, bs = args.batch, args.context, 16
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, cfg.vocab_size, (B, C), generator=g)
    per = (C + 4 * args.steps + 2 + bs - 1) // bs
    tables = torch.arange(B * per).view(B, per)

    def meta_for(lens: list[int], new: int) -> AttentionMetadata:
        slots, qsl = [], [0]
        for b in range(B):
            for p in range(lens[b] - new, lens[b]):
                slots.append(int(tables[b, p // bs]) * bs + p % bs)
            qsl.append(qsl[-1] + new)
        return AttentionMetadata(torch.tensor(slots), qsl, list(lens), tables)

    caches = allocate_kv_cache(cfg, B * per, bs, dtype=dtype, device=dev)
    with torch.inference_mode():
        h = model(prompts.reshape(-1), torch.arange(C).repeat(B), caches, meta_for([C] * B, C))
        nxt = model.compute_logits(h.view(B, C, -1)[:, -1]).argmax(-1)
    lens = [C] * B

    def ours_step() -> None:
        nonlocal nxt, lens
        lens = [x + 1 for x in lens]
        meta = meta_for(lens, 1)
        with torch.inference_mode():
            nxt = model.compute_logits(model(nxt, torch.tensor([x - 1 for x in lens]), caches, meta)).argmax(-1)

    steps = {"prefixkv": ours_step}
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        hf = hf.to(dev).eval()
        with torch.inference_mode():
            out = hf(prompts.to(dev), use_cache=True, logits_to_keep=1)
        state = {"past": out.past_key_values, "tok": out.logits[:, -1].argmax(-1, keepdim=True)}

        def hf_step() -> None:
            with torch.inference_mode():
                o = hf(state["tok"], past_key_values=state["past"], use_cache=True)
            state["past"], state["tok"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)

        steps["transformers"] = hf_step

    print(f"torch {torch.__version__}, {dev}, {args.dtype}, batch {B}, context {C}, threads {torch.get_num_threads()}")
    for name, step in steps.items():
        for _ in range(3):
            step()
        _sync(dev)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            _sync(dev)
            times.append(time.perf_counter() - t)
        print(f"\n=== {name}: decode step median {statistics.median(times) * 1e3:.2f} ms over {args.steps}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        _sync(dev)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("--- cProfile, by own time:\n" + "\n".join(s.getvalue().splitlines()[4:]))
        activities = [torch.profiler.ProfilerActivity.CPU]
        if dev.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as p:
            for _ in range(args.steps):
                step()
            _sync(dev)
        ka = p.key_averages()
        print("--- torch.profiler, by host time:\n" + ka.table(sort_by="self_cpu_time_total", row_limit=args.top))
        if dev.startswith("cuda"):
            print("--- by device time:\n" + ka.table(sort_by="self_device_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
