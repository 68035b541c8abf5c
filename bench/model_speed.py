"""Model forward speed: prefixkv's paged model vs transformers, same weights, same process.

    .venv/bin/python bench/model_speed.py [--prompt 1024] [--context 256] [--steps 20] [--reps 3]
        [--dtype float32|bfloat16] [--device cpu|cuda] [--plain-too] [--batches 1,8] [--model FOLDER]
        [--layouts engine,transposed,packed,plain,dual] [--torch-attention-too]

Reports medians: prefill tok/s for one --prompt-token prompt, and decode ms/step at each of
--batches with --context tokens of context per sequence. Both sides use --dtype (float32 by
default). transformers loads the same GGUF (needs `accelerate`). On CPU our model runs with its
weights laid out as the engine lays them out (`LlamaModel.pack_for_cpu`: bfloat16 packed for
oneDNN, float32 in two layouts chosen by row count - DualLayoutLinear); `--plain-too` also times
it with plain F.linear weights, alternated in the same run, which is what the layout buys.
`--layouts` (float32) times one model per named layer layout instead, alternated step by step:
inside the whole model, where the weights stream from memory layer after layer, the ranking can
differ from a one-matmul microbenchmark's (bench/levers.py), whose weights stay in cache.
`--torch-attention-too` also times each model with the native CPU kernels off
(prefixkv/model/kernels/ops.py: prefill and decode attention, add + RMSNorm), so PyTorch's SDPA
(after a gather, for decode) in their place, alternated rep by rep and step by step.
`--layer-by-layer-too` also times each model's decode steps with its layers called one by one
from Python (`fused_decode` off) where the engine runs them in one native call
(csrc/decode_layers.cpp), alternated step by step: what that call buys.

`--hf-compile` also times transformers' model under `torch.compile` (fullgraph, static shapes, a
StaticCache; on CUDA mode "reduce-overhead", which replays CUDA graphs, as transformers documents for
fast generation), alternated with the others: the strongest plain-PyTorch peer on the same card.
Its compile time (each decode batch size compiles again) is printed, not timed.

Each figure also prints its fraction of this machine's ceiling, measured in the same process first
(bench/ceiling.py; `--no-ceiling` skips it): prefill as FLOP/s achieved (2 x parameters x tokens plus
causal attention and the LM head row) over the dtype's measured GEMM FLOP/s, decode as bytes read
per second (every weight once, plus each sequence's K and V) over the measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.arg_types import ints  # noqa: E402
from bench.ceiling import decode_bytes, fraction, measure, measure_cuda, prefill_flops  # noqa: E402
from bench.machine import describe  # noqa: E402


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


LAYOUTS = ("engine", "plain", "transposed", "packed", "dual")


def lay_out(model, name: str) -> str:
    """Lay out `model`'s layer weights as `name` (the head always as the engine lays it out);
    returns the class now doing the layers' matmuls."""
    from prefixkv.model.layers import DualLayoutLinear, PackedLinear, TransposedLinear, pack_linears

    if name not in LAYOUTS:
        raise SystemExit(f"--layouts: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
    if name != "plain":
        model.pack_for_cpu()
    if name in ("transposed", "packed", "dual"):
        kind = {"transposed": TransposedLinear, "packed": PackedLinear, "dual": DualLayoutLinear}[name]
        for layer in model.layers:  # re-lay the engine's layout out: back to nn.Linear first
            for parent in list(layer.modules()):
                for attr, child in list(parent.named_children()):
                    if hasattr(child, "out_features") and not isinstance(child, torch.nn.Linear):
                        w = child.weight_t.t() if isinstance(child, TransposedLinear) else child.weight
                        if isinstance(child, PackedLinear):
                            raise SystemExit("--layouts: float32 only (bfloat16 layers are packed only)")
                        lin = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                        lin.weight.data = w.contiguous()
                        if child.bias is not None:
                            lin.bias.data = child.bias
                        setattr(parent, attr, lin)
        pack_linears(model.layers, kind)
    return type(model.layers[0].mlp.down_proj).__name__


COMPILED = "transformers+compile"


class CompiledTransformers:
    """transformers' model under torch.compile (fullgraph, static shapes) over a StaticCache: on
    CUDA mode "reduce-overhead" (CUDA graphs), elsewhere inductor's default. A decode batch keeps
    its cache and feeds each step's greedy token back, as generate does."""

    WARM_STEPS = 3  # the compile, then the graphs' recording (cudagraph trees record on a later call)

    def __init__(self, hf, device: str) -> None:
        self.hf, self.device = hf, torch.device(device)
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.forward = torch.compile(hf.forward, mode=mode, fullgraph=True, dynamic=False)
        self.prefill_cache = None
        self.cache = None
        self.tok: torch.Tensor | None = None
        self.position = 0

    def _call(self, ids: torch.Tensor, cache, start: int):
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        with torch.inference_mode():
            out = self.forward(
                input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True, logits_to_keep=1
            )
        return out.logits[:, -1].argmax(-1, keepdim=True).clone()

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        from transformers import StaticCache

        if self.prefill_cache is None:
            self.prefill_cache = StaticCache(config=self.hf.config, max_cache_len=ids.numel())
        with torch.inference_mode():  # its tensors were made in inference mode (at the first call)
            self.prefill_cache.reset()
        return self._call(ids[None].to(self.device), self.prefill_cache, 0)

    def start_decode(self, prompts: torch.Tensor, steps: int) -> None:
        """Prefills `prompts` [B, C] eagerly into a fresh StaticCache with room for the warm-up and
        `steps` steps, then runs the warm-up steps (compiling for this batch size)."""
        from transformers import StaticCache

        B, C = prompts.shape
        self.cache = StaticCache(config=self.hf.config, max_cache_len=C + self.WARM_STEPS + steps + 1)
        positions = torch.arange(C, device=self.device)
        with torch.inference_mode():
            out = self.hf(
                input_ids=prompts,
                past_key_values=self.cache,
                cache_position=positions,
                use_cache=True,
                logits_to_keep=1,
            )
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)
        self.position = C
        for _ in range(self.WARM_STEPS):
            self.step()

    def step(self) -> torch.Tensor:
        assert self.tok is not None
        self.tok = self._call(self.tok, self.cache, self.position)
        self.position += 1
        return self.tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    ap.add_argument(
        "--no-pack",
        action="store_true",
        help="CPU: plain F.linear weights (the engine packs bfloat16 for oneDNN, transposes float32)",
    )
    ap.add_argument("--plain-too", action="store_true", help="also time our model with plain F.linear weights")
    ap.add_argument(
        "--layouts",
        default=None,
        help="CPU: time our model once per weight layout, alternated step by step in this process "
        f"(comma-separated, of: {', '.join(LAYOUTS)}; 'engine' = what pack_for_cpu picks)",
    )
    ap.add_argument("--batches", type=ints, default=[1, 8], help="decode batch sizes (comma-separated)")
    ap.add_argument(
        "--torch-attention-too",
        action="store_true",
        help="CPU: also time each model with the native kernels off (prefixkv/model/kernels/ops.py: "
        "PyTorch's SDPA for prefill and decode attention), alternated rep by rep and step by step",
    )
    ap.add_argument(
        "--layer-by-layer-too",
        action="store_true",
        help="CPU: also time each model's decode steps with its layers called one by one (fused_decode off), "
        "alternated step by step",
    )
    ap.add_argument("--no-ceiling", action="store_true", help="skip measuring the machine's ceiling first")
    ap.add_argument(
        "--model",
        default=None,
        help="an HF checkpoint folder (default: the embedded SmolLM2-135M GGUF); e.g. the random-weight "
        "1B-8B shapes of bench/device/random_checkpoint.py",
    )
    ap.add_argument(
        "--no-cudnn-attention",
        action="store_true",
        help="CUDA: turn torch's cuDNN attention off process-wide, for transformers' side (prefixkv's model "
        "never uses it: it plans every new shape, 1.3 ms of host time a decode call on an H200)",
    )
    ap.add_argument(
        "--hf-compile",
        action="store_true",
        help="also time transformers under torch.compile with a StaticCache (CUDA: CUDA graphs)",
    )
    ap.add_argument(
        "--no-prefill",
        action="store_true",
        help="decode only (under --hf-compile each shape compiles apart: on an H200 a 1,024-token prefill "
        "of the default model took over 200 s)",
    )
    args = ap.parse_args()
    if args.hf_compile and args.no_hf:
        raise SystemExit("--hf-compile times transformers: not with --no-hf")
    print(describe(), flush=True)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)

    if args.threads:
        torch.set_num_threads(args.threads)
    ceiling = None
    if not args.no_ceiling:
        dt = (getattr(torch, args.dtype),)
        ceiling = measure(dt, quick=True) if args.device == "cpu" else measure_cuda(dt, args.device)
        print(f"load average {os.getloadavg()[0]:.2f}; this machine's ceiling, measured now (bench/ceiling.py):")
        for line in ceiling.lines():
            print("  " + line)
    from prefixkv.memory.block_tensors import allocate_kv_cache
    from prefixkv.model import AttentionMetadata, default_model_path, load_model
    from prefixkv.model.kernels import ops

    dev = args.device
    dtype = getattr(torch, args.dtype)
    lm = load_model(args.model, dtype=dtype, device=dev)
    model, cfg = lm.model, lm.config
    if dev == "cpu" and not args.no_pack:
        print(f"weights laid out for the CPU (as the engine runs): {model.pack_for_cpu()}")
    # our model under each name timed: "ours" as the engine runs it, and with --plain-too the same
    # weights as plain nn.Linear (F.linear), alternated with it in this process
    ours_models = {"ours": model}
    if args.plain_too:
        ours_models["ours, plain"] = load_model(args.model, dtype=dtype, device=dev).model
    if args.layouts:
        ours_models = {}
        for name in args.layouts.split(","):
            fresh = name != "engine" or args.no_pack
            ours_models[name] = load_model(args.model, dtype=dtype, device=dev).model if fresh else model
            print(f"layout {name}: {lay_out(ours_models[name], name)}")
    # names timed with the PyTorch decode attention instead of the native kernel (--torch-attention-too)
    torch_attention: set[str] = set()
    layer_by_layer: set[str] = set()  # names timed with fused_decode off (--layer-by-layer-too)
    if args.layer_by_layer_too:
        for name in list(ours_models):
            ours_models[name + ", layer by layer"] = ours_models[name]
            layer_by_layer.add(name + ", layer by layer")
    if args.torch_attention_too:
        for name in list(ours_models):
            ours_models[name + ", torch attn"] = ours_models[name]
            torch_attention.add(name + ", torch attn")
    bs = args.block_size
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        if args.model:
            hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(dev).eval()
        else:
            path = default_model_path()
            hf = (
                AutoModelForCausalLM.from_pretrained(
                    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
                )
                .to(dev)
                .eval()
            )
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {dev}, {args.dtype}")

    # ------------------------------------------------------------ prefill
    n = args.prompt
    ids = torch.randint(100, vocab, (n,), generator=g)
    nblocks = (n + bs - 1) // bs
    caches = allocate_kv_cache(cfg, nblocks + 8, bs, dtype=dtype, device=dev)
    blocks = torch.randperm(nblocks + 8, generator=g)[:nblocks]
    pos = torch.arange(n)
    slots = blocks[pos // bs] * bs + pos % bs

    def ours_prefill(m=model, torch_attention=False):
        meta = AttentionMetadata(slots, [0, n], [n], blocks[None])
        with ops.disabled() if torch_attention else contextlib.nullcontext():
            h = m(ids, pos, caches, meta)
            return m.compute_logits(h[-1:])

    def hf_prefill():
        with torch.inference_mode():
            return hf(ids[None].to(dev), use_cache=True, logits_to_keep=1).logits

    compiled = CompiledTransformers(hf, dev) if args.hf_compile else None

    def hf_compiled_prefill():
        assert compiled is not None
        return compiled.prefill(ids)

    # ours and transformers alternate rep by rep so load drift on a shared machine hits both
    fns = [(name, lambda m=m, t=name in torch_attention: ours_prefill(m, t)) for name, m in ours_models.items()]
    fns += [("transformers", hf_prefill)] if hf is not None else []
    fns += [(COMPILED, hf_compiled_prefill)] if compiled is not None else []
    if args.no_prefill:
        fns = []
    times = {name: [] for name, _ in fns}
    if fns:
        print(f"  ... prefill, {n} tokens: warm-up and {args.reps} reps", flush=True)
    for name, fn in fns:
        start = time.perf_counter()
        for _ in range(3 if name == COMPILED else 1):  # compiled: the compile, then its graphs' recording
            fn()  # warm-up
        if name == COMPILED:
            print(f"  ... {COMPILED}: prefill compiled and warmed up in {time.perf_counter() - start:.1f} s")
    for _ in range(args.reps):
        for name, fn in fns:
            times[name].append(timed(fn, dev)[0])
    for name, _ in fns:
        med = statistics.median(times[name])
        line = f"prefill {n} tok  {name:21s}: median {med * 1000:8.1f} ms  = {n / med:8.1f} tok/s"
        if ceiling is not None:
            achieved = prefill_flops(cfg, n) / med
            line += f"  ({achieved / 1e9:.0f} GFLOP/s, {fraction(achieved, ceiling.flops_of(dtype))})"
        print(line)

    # ------------------------------------------------------------ decode
    for B in args.batches:
        print(f"  ... decode, batch {B}: {args.steps} steps", flush=True)
        C = args.context
        prompts = torch.randint(100, vocab, (B, C), generator=g)
        per = (C + args.steps + 2 + bs - 1) // bs
        tables = torch.randperm(B * per + 4, generator=g)[: B * per].view(B, per)

        def step_meta(lens, new):
            slot_list, qsl = [], [0]
            for b in range(B):
                for p in range(lens[b] - new, lens[b]):
                    slot_list.append(int(tables[b, p // bs]) * bs + p % bs)
                qsl.append(qsl[-1] + new)
            return AttentionMetadata(torch.tensor(slot_list), qsl, list(lens), tables)

        with torch.inference_mode():
            # prefill all B sequences (one batch) on every side, then decode step by step,
            # alternating the sides
            state = {}
            for name, m in ours_models.items():
                caches = allocate_kv_cache(cfg, B * per + 4, bs, dtype=dtype, device=dev)
                h = m(prompts.reshape(-1), torch.arange(C).repeat(B), caches, step_meta([C] * B, C))
                state[name] = (caches, m.compute_logits(h.view(B, C, -1)[:, -1]).argmax(-1))
            lens = [C] * B
            if hf is not None:
                out = hf(prompts.to(dev), use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            ts: dict[str, list[float]] = {name: [] for name in ours_models}
            ts_hf = []
            ts_compiled: list[float] = []
            if compiled is not None:
                start = time.perf_counter()
                compiled.start_decode(prompts.to(dev), args.steps)
                print(f"  ... {COMPILED}: batch {B} compiled and warmed up in {time.perf_counter() - start:.1f} s")
            for _ in range(args.steps):
                lens = [x + 1 for x in lens]
                positions = torch.tensor([x - 1 for x in lens])
                for name, m in ours_models.items():
                    caches, nxt = state[name]
                    meta = step_meta(lens, 1)  # a fresh one per forward (its plan is cached inside)
                    m.fused_decode = name not in layer_by_layer
                    with ops.disabled() if name in torch_attention else contextlib.nullcontext():
                        dt, logits = timed(lambda: m.compute_logits(m(nxt, positions, caches, meta)), dev)
                    state[name] = (caches, logits.argmax(-1))
                    ts[name].append(dt)
                if hf is not None:
                    dt, out = timed(lambda: hf(tok, past_key_values=past, use_cache=True), dev)
                    past = out.past_key_values
                    tok = out.logits[:, -1].argmax(-1, keepdim=True)
                    ts_hf.append(dt)
                if compiled is not None:
                    ts_compiled.append(timed(compiled.step, dev)[0])
        ref = statistics.median(ts_hf[2:]) if hf is not None else None
        for name in ours_models:
            ours = statistics.median(ts[name][2:])
            line = f"decode batch {B} ctx {C}  {name}: {ours * 1000:7.1f} ms/step"
            if ref is not None:
                line += f"   transformers: {ref * 1000:7.1f} ms/step   (speedup x{ref / ours:.2f})"
            if ceiling is not None:
                read = decode_bytes(cfg, dtype, B, C + args.steps // 2) / ours
                line += f"   reads {read / 1e9:.1f} GB/s, {fraction(read, ceiling.bytes_per_s)}"
            print(line)
        if compiled is not None:
            t = statistics.median(ts_compiled[2:])
            ours = statistics.median(ts["ours"][2:]) if "ours" in ts else t
            print(f"decode batch {B} ctx {C}  {COMPILED}: {t * 1000:7.1f} ms/step   (ours: speedup x{t / ours:.2f})")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
