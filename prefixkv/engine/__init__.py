"""The engine: one step is schedule -> execute -> update -> emit (see docs/design.md).

llm_engine.py           LLMEngine: admission (atomic), the step loop, request groups, errors, stats
scheduler.py            Scheduler: owns the KVCacheManager; batching, chunked prefill, preemption
scheduler_output.py     SchedulerOutput / ScheduledRequest: what crosses to the runner
model_runner.py         ModelRunner: tensors, the forward pass, sampling, prompt logprobs
model_runner_output.py  ModelRunnerOutput / PromptLogprobs: what comes back
block_tensors.py        every per-block tensor (KV per layer, ...) and the one memory budget
huge_pages.py           large CPU tensors on 2 MiB pages where Linux offers them (the K/V caches)
sampler.py              sampling math; output_processor.py: text, stop conditions
stats.py                EngineStats: the thread-safe snapshot for metrics
"""
