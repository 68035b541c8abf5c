"""Which engine replica gets a request: its prompt's block hashes, the prefix index, the policy.

Per routed request (POST /v1/completions, /v1/chat/completions):
  1. hash the prompt's full blocks (prompt_hashes.py; in a worker thread), a LoRA request with its
     adapter's block key;
  2. choose among the replicas that are up: round-robin, prefix or prefix-load (prefixkv/router/policy.py)
     over loads = (queue: requests sent and not yet answered with a first byte, or the engine's
     waiting count if larger; running; KV usage from the last poll);
  3. record the request in the index (events mode: a pending entry until its first byte; approx:
     the blocks it sent).
The index follows the replica set: a replica that leaves has its entries forgotten at once; one
that joins (new, or restarted by Serve) starts from nothing and its KV events are subscribed to.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from ..engine_args import EngineArgs
from ..kv_events.wire import ExternalBlockHash
from ..model.default_model import DEFAULT_MODEL_NAME, default_model_path
from ..model.tokenizer_loader import load_tokenizer
from ..router import PrefixIndex, Router, make_router
from .args import router_knobs
from .event_feed import EventFeed
from .prompt_hashes import LoRABlockKey, PromptHasher
from .replica_set import Replica

logger = logging.getLogger("prefixkv.replicas")


def _check_reachable(r: Replica, host: str, node_ip: str) -> None:
    """A replica on another node of the cluster bound its events on its own loopback (--host is
    loopback): this ingress cannot subscribe, so the index stays without its events. Said once
    per join rather than left to a silent miss."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return
    here = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if loopback and node_ip != here:
        logger.warning(
            "engine replica %d runs on node %s but publishes its KV events on its loopback (--host %s): "
            "the router cannot read them from node %s; give --host an address the nodes reach "
            "(e.g. 0.0.0.0) for the precise index",
            r.index,
            node_ip,
            host,
            here,
        )


class ReplicaChooser:
    """The policy, and for the prefix policies the prompt hasher and the index its replicas'
    events feed; a MembershipListener of the ReplicaSet."""

    def __init__(
        self,
        policy: Router,
        base_names: set[str],
        index: PrefixIndex | None = None,
        hasher: PromptHasher | None = None,
    ) -> None:
        self.policy = policy
        self.base_names = base_names  # the base model's served names: any other `model` may be an adapter
        self.index = index
        self.hasher = hasher
        self._feeds: dict[int, asyncio.Task[None]] = {}  # replica index -> its event feed (events modes)
        self._request_seq = 0

    @classmethod
    async def create(cls, args: argparse.Namespace, first_info: dict[str, Any]) -> ReplicaChooser:
        """The chooser for `prefixkv serve` flags `args`, its hasher and index sized and checked
        against the first replica's info()."""
        config = EngineArgs.from_cli_args(args)
        base_names = set(args.served_model_name or [config.model or DEFAULT_MODEL_NAME])  # as the replicas
        if args.router == "round-robin":
            return cls(make_router(args.router, None), base_names)
        tokenizer_path = config.tokenizer or config.model or default_model_path()
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_path)
        if getattr(args, "chat_template", None):
            tokenizer.set_chat_template(args.chat_template)
        approx = args.router_index == "approx"
        algo = "sha256_cbor" if approx else first_info["hash_algo"]
        hasher = PromptHasher(tokenizer, first_info["block_size"], algo)
        if not approx and hasher.root != first_info["root_hash"]:
            raise RuntimeError("the router's root block hash differs from the replicas' (hash seed?)")
        index = PrefixIndex(args.router_index, approx_capacity_blocks=first_info["num_blocks"] if approx else None)
        return cls(make_router(args.router, index, **router_knobs(args)), base_names, index, hasher)

    # -- membership (MembershipListener) ---------------------------------------------------------
    def joined(self, replica: Replica) -> None:
        self._stop_feed(replica)
        if self.index is None:
            return
        self.index.remove_replica(replica.index)
        self.index.add_replica(replica.index)
        if self.index.mode != "approx":
            info = replica.info
            host = info.get("events_host", info["node_ip"])
            _check_reachable(replica, host, info["node_ip"])
            feed = EventFeed(self.index, replica.index, host, info["pub_port"], info["replay_port"], info["topic"])
            self._feeds[replica.index] = asyncio.get_running_loop().create_task(feed.run())

    def left(self, replica: Replica) -> None:
        self._stop_feed(replica)
        if self.index is not None:
            self.index.remove_replica(replica.index)

    def _stop_feed(self, replica: Replica) -> None:
        feed = self._feeds.pop(replica.index, None)
        if feed is not None:
            feed.cancel()

    # -- one request -------------------------------------------------------------------------------
    async def request_route(
        self, path: str, body: bytes, adapter_key: Callable[[str], Awaitable[LoRABlockKey | None]]
    ) -> tuple[list[ExternalBlockHash], str | None]:
        """The block hashes of a routed request's prompt ([] when they cannot be known here) and
        its `prompt_cache_key` (None when absent); `adapter_key` names the block key of the
        adapter the body's `model` may name."""
        try:
            parsed = json.loads(body)
        except ValueError:  # the replica answers the 400
            return [], None
        if not isinstance(parsed, dict):
            return [], None
        cache_key = parsed.get("prompt_cache_key")
        cache_key = cache_key if isinstance(cache_key, str) else None  # a wrong type: the replica's 400
        hasher = self.hasher
        if hasher is None:
            return [], cache_key
        model = parsed.get("model")
        key = None
        if isinstance(model, str) and model not in self.base_names:
            key = await adapter_key(model)
            if key is None:  # an unknown model (the replica answers 404) or no answer: by load
                return [], cache_key
        return await asyncio.to_thread(hasher.hashes, path, parsed, key), cache_key  # off the event loop

    def choose(
        self, hashes: list[ExternalBlockHash], live: list[Replica], exclude: set[int], cache_key: str | None = None
    ) -> Replica | None:
        """The replica among `live` (but those in `exclude`) that gets a request with `hashes`
        (and `cache_key`, its prompt_cache_key)."""
        candidates = [r for r in live if r.index not in exclude]
        if not candidates:
            return None
        i = self.policy.choose(hashes, [r.index for r in candidates], [r.load() for r in candidates], cache_key)
        return candidates[i]

    def sent(self, replica: Replica, hashes: list[ExternalBlockHash]) -> int:
        """Record a request with `hashes` sent to `replica`; the id to pass to answered()."""
        self._request_seq += 1
        rid = self._request_seq
        if self.index is not None and hashes:
            if self.index.mode == "approx":
                self.index.record_sent(replica.index, hashes)
            else:
                self.index.add_pending(replica.index, rid, hashes)
        return rid

    def answered(self, rid: int) -> None:
        """Request `rid` has its first byte, or failed: the replica's events now speak for its blocks."""
        if self.index is not None and self.index.mode != "approx":
            self.index.resolve_pending(rid)
