"""The engine: one step is schedule -> execute -> update -> emit (see docs/design.md).

llm_engine.py           LLMEngine: admission (atomic), the step loop, request groups, errors, stats
scheduler.py            Scheduler: owns the KVCacheManager; batching, chunked prefill, preemption
scheduler_output.py     SchedulerOutput / ScheduledRequest: what crosses to the runner
model_runner.py         ModelRunner: tensors, the forward pass, sampling, prompt logprobs
model_runner_output.py  ModelRunnerOutput / PromptLogprobs: what comes back
sampler.py              sampling math; output_processor.py: text, stop conditions
beam_search.py          BeamSearch: vLLM's beam search over one-token requests; beam_output.py: its results
stats.py                EngineStats: the thread-safe snapshot for metrics
"""
