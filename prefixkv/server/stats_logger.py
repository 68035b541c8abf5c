"""The periodic stats line `vllm serve` prints (vLLM's LoggingStatLogger), with the prefix-cache
hit rate: every VLLM_LOG_STATS_INTERVAL seconds (default 10), at INFO while there is work, off with
--disable-log-stats. Reads the engine's published EngineStats snapshot, never its live state."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

logger = logging.getLogger("prefixkv.stats")

DEFAULT_INTERVAL_S = 10.0


def interval_from_env() -> float:
    try:
        value = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class StatsLogger:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        s = engine.get_stats()
        self._last = (time.monotonic(), s.num_prompt_tokens, s.num_generation_tokens)
        self._last_cache = (s.prefix_cache_queries, s.prefix_cache_hits)

    def line(self) -> str | None:
        """The line for the time since the last call, or None when nothing ran (vLLM logs those
        at DEBUG). The hit rate is over the tokens looked up in this interval (cumulative when
        none were)."""
        s = self.engine.get_stats()
        now = time.monotonic()
        t0, prompt0, gen0 = self._last
        q0, h0 = self._last_cache
        dt = max(now - t0, 1e-9)
        prompt_tps = (s.num_prompt_tokens - prompt0) / dt
        gen_tps = (s.num_generation_tokens - gen0) / dt
        dq, dh = s.prefix_cache_queries - q0, s.prefix_cache_hits - h0
        hit_rate = dh / dq if dq > 0 else s.prefix_cache_hit_rate
        self._last = (now, s.num_prompt_tokens, s.num_generation_tokens)
        self._last_cache = (s.prefix_cache_queries, s.prefix_cache_hits)
        if not (prompt_tps or gen_tps or s.num_running or s.num_waiting):
            return None
        return (
            f"Engine 000: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tps:.1f} tokens/s, Running: {s.num_running} reqs, "
            f"Waiting: {s.num_waiting} reqs, GPU KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            text = self.line()
            if text is not None:
                logger.info(text)
