#!/usr/bin/env bash
# Run on the lent GPU machine, from the repository root, right after `bash bench/device/stage.sh 1`
# (docs/benchmarks.md, "CUDA: the day a GPU is lent"): the CUDA checks of issue 16 in one command,
# each bounded so that the whole ends by $BUDGET seconds (default 540), every log in $OUT.
# $STEPS picks and orders them (default: equality graphs model_speed shared_prefix suite model_speed_hf;
# issue 40's Triton attention: STEPS="equality paged"; its CUDA graphs and fused kernels:
# STEPS="equality graphs large", or STEPS="verify graphs large" where the lease is short):
#   equality        the CUDA-vs-CPU model equality and tests/engine/test_cuda.py (the engine on the
#                   GPU against the transformers oracle, caching on and off, blocks freed), the
#                   Triton paged-attention kernels and the engine on them (compiled here), and
#                   tests/engine/test_cuda.py again with PREFIXKV_CUDA_ATTENTION=triton; every engine
#                   there replays its decode steps as CUDA graphs (the default on a GPU), and
#                   tests/engine/test_cuda_graphs.py compares a replay with the same forward run
#                   eagerly, bit for bit; tests/model/test_triton_fused.py the fused norm, rotary
#                   and SiLU kernels against PyTorch's
#   verify          the shorter equality: the fused kernels, tests/engine/test_cuda.py and the graphs
#                   tests (decode, mixed, with LoRA adapters against peft, KV-cache groups (Gemma 3,
#                   Qwen2's sliding layers), routed experts)
#   sweep           tests/engine/sweep_graphs.py: the same requests through captured graphs (FULL,
#                   scheduled ahead) and an eager in-order engine, float32, across families (Llama,
#                   Gemma 2, Qwen3-MoE, Qwen3-Next, DeepSeek-V3's 576-wide latent head, LoRA, LLaVA's
#                   image steps; the CPU runs more) and
#                   features (logprobs, prompt logprobs, seeded sampling with n=2, stops, penalties,
#                   structured outputs, preemption): tokens, finishes, cached tokens and logprobs equal
#   graphs          bench/decode_graphs.py: decode ms/step through the engine at batch 1/32/256
#                   (bfloat16, 256-token contexts), CUDA graphs with async scheduling (the default)
#                   against enforce_eager=True, against graphs stepped in order and against graphs
#                   without the fused kernels (PREFIXKV_CUDA_KERNELS=0), alternated; the capture's
#                   sizes, time and memory in the log
#   sampled         the same, sampled (temperature 0.8, top-p 0.9, a seed a request) at batch 1/32,
#                   the default engine (draws in graphs: engine/graph_sampling.py) against eager;
#                   then a repetition penalty at batch 1/32/256, scheduled ahead against in order, then
#                   structured outputs (a regex) the same way
#   paged           bench/paged_attention.py: one layer's attention, Triton's kernels reading the
#                   blocks in place against the gather path, decode and prefill after 1k/8k context
#                   at batch 1/32/256 (bfloat16), the default model's heads, an 8B Llama's, and 32
#                   sequences behind a shared 1k prefix (the cascade); then model_speed's decode
#                   with each path
#   model_speed     bench/model_speed.py on the GPU in bfloat16: prefill tok/s, decode ms/step at 1/32/256;
#                   then the default model's 8,192-token prefill
#   compiled        model_speed beside transformers and transformers under torch.compile (StaticCache,
#                   CUDA graphs: --hf-compile), decode at batch 1 alone, for the default model and,
#                   after `large`, the 1B shape (each shape compiles apart: on the H200 the default
#                   model's 1k prefill alone did not compile within 200 s)
#   fused_eager     model_speed (eager: no graphs) with the fused kernels and without
#   large           a random-weight Llama-3.2-1B-shaped checkpoint written here
#                   (bench/device/random_checkpoint.py, SmolLM2's vocabulary; $SHAPE: llama-3b, llama-8b),
#                   then the graphs step's measurement and model_speed (with transformers, a
#                   1,024- and an 8,192-token prefill) on it
#   families        today's other families as random checkpoints near their published shapes
#                   (bench/device/random_checkpoint.py: gemma3-1b's sliding and full layers,
#                   falcon-h1-0.5b's Mamba2 mixers beside attention, qwen3-next-small's delta nets and
#                   routed experts): decode_graphs' graphs against eager and in order at batch 1/32,
#                   and mixed_steps' 128-token prompt beside 0/32 decodes (mixed graphs up to the
#                   count the engine timed, the recurrent ones' scan over fixed buffers included,
#                   against decode graphs only)
#   shared_prefix   bench/shared_prefix.py (the LLM picks the GPU, bfloat16)
#   serve           bench/serve.py: `prefixkv serve` on the GPU (bfloat16) under streamed requests
#                   arriving at 16/s, a shared prefix and unique prompts: TTFT and TPOT, one server
#                   with the default (mixed steps replayed up to the count it timed at its start)
#                   and one with decode graphs only
#   mixed           bench/mixed_steps.py: a prompt of 16/128/1,024 tokens arriving beside 0/32/128
#                   running decodes, the time to its token: the default (mixed steps replayed up to
#                   the count the engine timed at its start; its choice in the log) against every
#                   mixed step replayed (FULL) and none (FULL_DECODE_ONLY); then a 6,000-token
#                   prompt in chunks beside 32/128 decodes, scheduled ahead against in order
#   suite           the whole suite with CUDA present (pytest-xdist over the cores; no redis-server or
#                   Ray there, so those are left out)
#   model_speed_hf  model_speed beside transformers on the same GPU (cuDNN attention off for it too)
#   profile         bench/profile_decode.py: where a decode step's host and device time go
#   host            bench/host_overhead.py --device-time with the engine's GPU defaults (graphs, async
#                   scheduling), at batch 1/32/256: the host's work per step beside the device's busy
#                   time and kernel count, for the tiny model, the default model and, after `large`, the
#                   1B shape - which of the two bounds a step
#   host_profile    the same at batch 1 with --profile-top: operators and CUDA runtime calls by host
#                   time, kernels by device time, a cProfile round (the default model, the 1B shape)
#   host_ab         host_overhead.py on the card, this tree against the commit in .device/base (prepare.sh
#                   BASE=<commit>), runs alternated, paired ratios: what a change to the host's work
#                   bought (the default model, batch 1 and 32; greedy, then sampled, then greedy with
#                   5 top logprobs a row, then structured outputs: a regex, then a repetition penalty,
#                   then the penalty with 5 top logprobs a row)
#   ahead           bench/steps_ahead.py: loglikelihood requests (prompt logprobs), embeddings and a
#                   pipeline's thinker (hidden states) arriving beside decodes, async against in order,
#                   then again with every completed block saved to a CPU tier;
#                   bench/loglikelihood.py: lm-eval's loglikelihood requests, against .device/base if there
#   host_calls      bench/cuda_host_calls.py: the host's cost of each CUDA call a replayed step makes
#                   (staging, copies, events, launches, a replay by its node count), per-step page-
#                   locked staging against persistent buffers
#   gemv            bench/fused_gemv.py: the residual add and norm, or SiLU-and-multiply, folded into
#                   the batch-1 product after it (a Triton kernel, autotuned here) against the
#                   engine's fused step then cuBLAS, and cuBLAS alone, at the 1B's and the default
#                   model's products, device time and share of the bandwidth
#   threads         whether this machine's CPU gives the same bits on every thread count
#                   (engine/cpu_threads.thread_counts_agree) and the tests that depend on it
#   lora            bench/lora.py on the GPU (bfloat16): 1 and 4 random rank-16 adapters in mixed traffic
#                   against the base model, with CUDA graphs (adapter steps replay the LoRA graphs)
#                   and with --enforce-eager
#   issue40         the preset for issue 40's open rows, most wanted first: verify mixed lora families
#                   host_profile host_ab sampled ahead host_calls gemv serve large host model_speed shared_prefix compiled sweep (what
#                   the budget leaves is skipped, and said so)
set -u
BUDGET=${BUDGET:-540}
STEPS=${STEPS:-equality graphs model_speed shared_prefix suite model_speed_hf}
STEPS=${STEPS/issue40/verify mixed lora families host_profile host_ab sampled ahead host_calls gemv serve large host model_speed shared_prefix compiled sweep}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
start=$SECONDS
bounded() {  # bounded SECONDS LOG CMD...: run CMD for at most SECONDS (less if the budget is short)
    local t=$1 log=$2 left
    shift 2
    left=$((BUDGET - (SECONDS - start)))
    [ "$t" -gt "$left" ] && t=$left
    if [ "$t" -lt 15 ]; then
        echo "skipped (budget spent): $*" | tee -a "$out/$log"
        return
    fi
    echo "== $* (at most ${t}s)" | tee -a "$out/$log"
    timeout "$t" "$@" 2>&1 | tee -a "$out/$log"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$out/$log"
}
{
    nvidia-smi -L
    lscpu | grep -E "Model name|^CPU\(s\)"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.log"
speed=(python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1,32,256)
for step in $STEPS; do
    case $step in
    equality)
        bounded 200 equality.log python3 -m pytest -q -p no:cacheprovider -rfE \
            tests/model/test_model_hf_folder.py::test_cuda_matches_cpu tests/engine/test_cuda.py \
            tests/model/test_triton_attention.py tests/engine/test_triton_attention_path.py \
            tests/engine/test_cuda_graphs.py tests/lora/test_lora_graphs.py tests/model/test_triton_fused.py \
            tests/engine/test_mixed_graph_choice.py tests/engine/test_graph_check.py \
            tests/model/test_host_copy.py tests/model/test_triton_scan.py tests/engine/test_moe_architectures.py \
            tests/engine/test_hybrid_attention.py::test_hybrid_decode_steps_replay_over_fixed_buffers \
            tests/engine/test_recurrent_graphs.py \
            tests/multimodal/test_llava_model.py::test_steps_with_images_replay_over_fixed_buffers \
            tests/engine/test_async_scheduling.py::test_the_decode_buffers_take_the_carried_tokens \
            tests/engine/test_async_scheduling.py::test_a_non_finite_row_of_a_replayed_decode_fails_alone \
            tests/engine/test_async_scheduling.py::test_prompt_outputs_of_replayed_steps_run_ahead \
            tests/engine/test_decode_host_inputs.py tests/model/test_triton_gemv.py tests/tiers/test_transfer.py \
            "tests/engine/test_sampler.py::test_the_fixed_shape_draw_is_samples_token_for_token"
        bounded 90 equality.log env PREFIXKV_CUDA_ATTENTION=triton python3 -m pytest -q -p no:cacheprovider -rfE \
            tests/engine/test_cuda.py ;;
    verify)
        bounded 240 equality.log python3 -m pytest -q -p no:cacheprovider -rfE tests/model/test_triton_fused.py \
            tests/model/test_host_copy.py tests/model/test_triton_scan.py \
            tests/engine/test_cuda.py tests/engine/test_cuda_graphs.py tests/lora/test_lora_graphs.py \
            tests/engine/test_mixed_graph_choice.py tests/engine/test_graph_check.py \
            tests/engine/test_hybrid_attention.py::test_hybrid_decode_steps_replay_over_fixed_buffers \
            "tests/engine/test_moe_architectures.py::test_moe_decode_steps_replay_over_fixed_buffers" \
            tests/engine/test_recurrent_graphs.py \
            tests/multimodal/test_llava_model.py::test_steps_with_images_replay_over_fixed_buffers \
            tests/engine/test_async_scheduling.py::test_a_non_finite_row_of_a_replayed_decode_fails_alone \
            tests/engine/test_async_scheduling.py::test_prompt_outputs_of_replayed_steps_run_ahead \
            tests/engine/test_decode_host_inputs.py tests/model/test_triton_gemv.py tests/tiers/test_transfer.py \
            "tests/engine/test_sampler.py::test_the_fixed_shape_draw_is_samples_token_for_token" ;;
    sweep)
        bounded 180 sweep.log python3 -m tests.engine.sweep_graphs --families llama,gemma2,qwen3_moe,qwen3_next,deepseek_v3_wide,lora,llava ;;
    paged)
        bounded 100 paged.log python3 bench/paged_attention.py --device cuda --dtype bfloat16 \
            --batches 1,32,256 --contexts 1024,8192 --new 64
        bounded 60 paged.log python3 bench/paged_attention.py --device cuda --dtype bfloat16 \
            --batches 1,32 --contexts 8192 --new 64 --heads 32,8 --head-dim 128
        bounded 40 paged.log python3 bench/paged_attention.py --device cuda --dtype bfloat16 \
            --batches 32 --contexts 1536 --shared 1024 --new 64
        for path in gather triton; do
            bounded 60 paged.log env PREFIXKV_CUDA_ATTENTION=$path "${speed[@]}" --no-hf
        done ;;
    graphs)
        bounded 200 graphs.log python3 bench/decode_graphs.py --device cuda --dtype bfloat16 \
            --batches 1,32,256 --context 256 --steps 24 --rounds 2 ;;
    sampled)
        bounded 90 sampled.log python3 bench/decode_graphs.py --device cuda --dtype bfloat16 \
            --batches 1,32 --context 256 --steps 24 --rounds 2 --engines graphs,eager --no-ceiling \
            --temperature 0.8 --top-p 0.9
        # penalized rows: scheduled ahead, drawn in graphs (logits edited in place), against in order
        bounded 90 sampled.log python3 bench/decode_graphs.py --device cuda --dtype bfloat16 \
            --batches 1,32,256 --context 256 --steps 24 --rounds 2 --engines graphs,inorder --no-ceiling \
            --repetition-penalty 1.1
        # structured outputs: a grammar's mask a row a step on the host, one bitmask copied; ahead against in order
        bounded 90 sampled.log python3 bench/decode_graphs.py --device cuda --dtype bfloat16 \
            --batches 1,32,256 --context 256 --steps 24 --rounds 2 --engines graphs,inorder --no-ceiling \
            --regex '[a-z ]{200,}' ;;
    large)
        big=/tmp/random-${SHAPE:-llama-1b}
        bounded 120 large.log python3 bench/device/random_checkpoint.py "$big" --shape "${SHAPE:-llama-1b}"
        bounded 150 large.log python3 bench/decode_graphs.py --model "$big" --device cuda --dtype bfloat16 \
            --batches 1,32,256 --context 256 --steps 16 --rounds 2 --engines graphs,inorder,unfused
        bounded 120 large.log "${speed[@]}" --model "$big" --no-cudnn-attention
        bounded 90 large.log python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1 \
            --prompt 8192 --context 8192 --model "$big" --no-cudnn-attention ;;
    families)
        for shape in gemma3-1b falcon-h1-0.5b qwen3-next-small; do
            fam=/tmp/random-$shape
            bounded 60 families.log python3 bench/device/random_checkpoint.py "$fam" --shape "$shape"
            bounded 90 families.log python3 bench/decode_graphs.py --model "$fam" --device cuda --dtype bfloat16 \
                --batches 1,32 --context 256 --steps 16 --rounds 1 --engines graphs,eager,inorder
            bounded 60 families.log python3 bench/mixed_steps.py --model "$fam" --device cuda --dtype bfloat16 \
                --decodes 0,32 --prompts 128 --repeats 4 --rounds 1 --engines default,decode-only --budget 512
        done ;;
    model_speed)
        bounded 100 model_speed.log "${speed[@]}" --no-hf
        bounded 60 model_speed.log python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1 \
            --prompt 8192 --context 8192 --no-hf ;;
    compiled)
        for m in default /tmp/random-${SHAPE:-llama-1b}; do
            model=()
            [ "$m" = default ] || model=(--model "$m")
            [ "$m" = default ] || [ -d "$m" ] || continue
            bounded 240 compiled.log python3 bench/model_speed.py --device cuda --dtype bfloat16 --batches 1 \
                --no-prefill --hf-compile --no-cudnn-attention --no-ceiling --steps 12 --reps 2 "${model[@]}"
        done ;;
    fused_eager)
        for on in 1 0; do
            bounded 45 fused_eager.log env PREFIXKV_CUDA_KERNELS=$on "${speed[@]}" --no-hf --no-ceiling
        done ;;
    shared_prefix) bounded 100 shared_prefix.log python3 bench/shared_prefix.py --repeats 3 ;;
    lora)
        for eager in "" --enforce-eager; do
            bounded 90 lora.log python3 bench/lora.py --device cuda --dtype bfloat16 --requests 32 --max-tokens 32 \
                --repeats 2 --adapters 1,4 $eager
        done ;;
    mixed)
        bounded 150 mixed.log python3 bench/mixed_steps.py --device cuda --dtype bfloat16 --decodes 0,32,128 \
            --prompts 16,128,1024 --repeats 8 --rounds 2
        # a prompt in chunks (the default budget, 2,048 tokens a step) beside decodes: its chunks
        # scheduled ahead against every step in order
        bounded 90 mixed.log python3 bench/mixed_steps.py --device cuda --dtype bfloat16 --decodes 32,128 \
            --prompts 6000 --repeats 4 --rounds 2 --engines default,inorder ;;
    serve)
        bounded 200 serve.log python3 bench/serve.py --dtype bfloat16 --workloads shared unique \
            --num-requests 64 --request-rate 16 --max-tokens 64 --cudagraph-mode default FULL_DECODE_ONLY ;;
    suite)
        bounded 240 suite.log python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --timeout 150 \
            --continue-on-collection-errors --ignore=tests/replicas --ignore=tests/server/test_langchain.py -k "not redis" ;;
    model_speed_hf) bounded 120 model_speed_hf.log "${speed[@]}" --no-cudnn-attention ;;
    profile) bounded 70 profile.log python3 bench/profile_decode.py --device cuda --batch 1 --steps 10 --top 25 ;;
    host)
        for m in "" default /tmp/random-${SHAPE:-llama-1b}; do
            [ -z "$m" ] || [ "$m" = default ] || [ -d "$m" ] || continue
            bounded 90 host.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32,256 \
                --rounds 2 --steps 24 --device-time ${m:+--model "$m"}
        done ;;
    host_profile)
        for m in default /tmp/random-${SHAPE:-llama-1b}; do
            [ "$m" = default ] || [ -d "$m" ] || continue
            bounded 60 host_profile.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1 \
                --rounds 1 --steps 24 --device-time --profile-top 30 --model "$m"
        done ;;
    host_ab)
        if [ -d .device/base ]; then
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2 --temperature 0.8 --top-p 0.9
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2 --logprobs 5
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2 --regex '[a-z ]{200,}'
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2 --repetition-penalty 1.1
            bounded 120 host_ab.log python3 bench/host_overhead.py --device cuda --dtype bfloat16 --batches 1,32 \
                --rounds 2 --steps 24 --model default --against .device/base --pairs 2 --repetition-penalty 1.1 \
                --logprobs 5
        else
            echo "host_ab: no .device/base (bench/device/prepare.sh BASE=<commit>)" | tee -a "$out/env.log"
        fi ;;
    host_calls) bounded 60 host_calls.log python3 bench/cuda_host_calls.py --batches 1,256 ;;
    ahead)
        bounded 90 ahead.log python3 bench/steps_ahead.py --device cuda --dtype bfloat16 --model default --rounds 3
        # every completed block saved to a CPU tier: its copies in stream order, sealed at booking
        bounded 60 ahead.log python3 bench/steps_ahead.py --device cuda --dtype bfloat16 --model default --rounds 3 \
            --decodes 32 --arrivals 16 --kv-offloading-size 2
        # the stage-output cache: its rows written when a step is booked (ran every step in order before)
        bounded 60 ahead.log python3 bench/steps_ahead.py --device cuda --dtype bfloat16 --model default --rounds 3 \
            --decodes 32 --arrivals 16 --enable-stage-output-cache
        # lm-eval's loglikelihood requests: prompts scored on the device now, on the host at the base commit
        if [ -d .device/base ]; then
            bounded 120 ahead.log python3 bench/loglikelihood.py --device cuda --dtype bfloat16 --model default \
                --requests 32 --prompt 1024 --rounds 3 --against .device/base --pairs 2
        else
            bounded 60 ahead.log python3 bench/loglikelihood.py --device cuda --dtype bfloat16 --model default \
                --requests 32 --prompt 1024 --rounds 3
        fi ;;
    gemv) bounded 120 gemv.log python3 bench/fused_gemv.py --shapes llama-1b,smollm2 ;;
    threads)
        bounded 120 threads.log python3 -m pytest -q -p no:cacheprovider -rfEs \
            tests/engine/test_cpu_threads.py -k "thread_count or adapts" ;;
    *) echo "unknown step $step" | tee -a "$out/env.log" ;;
    esac
done
