"""Two engine replicas under Ray Serve behind the prefix-load router (tiny model): one endpoint,
requests sharing a prefix land on the replica caching it, a saturated replica sheds load, greedy
outputs equal a single engine's, streaming and /metrics work, every KV block is free afterwards."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from .conftest import BLOCK, start_cluster, stop_cluster

# Ray + Serve + two engines: ~85 s for the module on 2 cores, most of it the package's Ray start
# and this module's deploy (the first test's setup)
pytestmark = pytest.mark.slow(seconds=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ray_serve, replica_model):
    from ..lora.conftest import write_adapter

    adapter = tmp_path_factory.mktemp("adapter") / "qv"
    write_adapter(replica_model, adapter, seed=7, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    # max_queue=1: a replica with one request not yet past prefill is saturated (the shed test)
    c = start_cluster(
        replica_model,
        ray_serve,
        router="prefix-load",
        max_queue=1,
        balance_abs=1,
        enable_lora=True,
        allow_runtime_lora_updating=True,
    )
    c.adapter = str(adapter)
    yield c
    stop_cluster(c)


def per_engine(cluster, name: str) -> dict[str, float]:
    """A router family by its engine label."""
    import re

    out = {}
    for line in cluster.client.get("/metrics").text.splitlines():
        m = re.match(rf'^{re.escape(name)}\{{replica="router",engine="(\d+)"\}}\s+(\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def complete(cluster, prompt, **kw):
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    res = cluster.client.post("/v1/completions", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def test_same_prefix_lands_on_the_replica_caching_it(cluster):
    prefix = "shared system prompt: " + "abcdefgh " * 12
    before = per_engine(cluster, "prefixkv:router_requests_total")
    a = complete(cluster, prefix + "first question")
    b = complete(cluster, prefix + "second question")
    after = per_engine(cluster, "prefixkv:router_requests_total")
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(prefix) - 2 * BLOCK and cached % BLOCK == 0  # one character per token here
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert sorted(delta.values()) == [0, 2]  # both on one replica
    cluster.wait_idle()


def test_chained_responses_reach_the_replica_that_stores_them(cluster):
    """Each replica keeps its own responses: turn two (previous_response_id) and a read go to the
    replica that made turn one, whichever replica the router picked for it."""
    homes = set()
    for i in range(4):  # new conversations are spread by load: both replicas make some
        body = {"model": cluster.model, "input": f"conversation {i}: hello", "max_output_tokens": 3}
        first = cluster.client.post("/v1/responses", json={**body, "temperature": 0})
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        homes.add(rid.split("_")[1])
        follow = {**body, "input": "and then?", "previous_response_id": rid, "temperature": 0}
        second = cluster.client.post("/v1/responses", json=follow)
        assert second.status_code == 200, second.text
        assert second.json()["id"].split("_")[1] == rid.split("_")[1]
        assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0  # turn one's prefix
        assert cluster.client.get(f"/v1/responses/{rid}").status_code == 200
    assert homes <= {"r0", "r1"}
    cluster.wait_idle()


def test_metrics_have_both_replicas_and_blocks_are_free(cluster):
    complete(cluster, "warm both? " * 3)
    m = cluster.wait_idle()
    for r in ("0", "1"):
        assert ("vllm:kv_cache_usage_perc", r) in m
        assert m[("vllm:num_requests_running", r)] == 0
    text = cluster.client.get("/metrics").text
    assert text.count("# TYPE vllm:kv_cache_usage_perc gauge") == 1  # one family, two labelled samples
    assert per_engine(cluster, "prefixkv:router_replica_up") == {"0": 1.0, "1": 1.0}
    # the router's index learned the replicas' cached blocks from their KV events
    index_blocks = per_engine(cluster, "prefixkv:router_index_blocks")
    cached = {r: m[("vllm:prefix_cache_queries_total", r)] for r in ("0", "1")}
    assert sum(index_blocks.values()) > 0, (index_blocks, cached)


def test_streaming_completion_and_chat(cluster):
    body = {"model": cluster.model, "prompt": "stream me ", "max_tokens": 5, "temperature": 0, "stream": True}
    with cluster.client.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200
        assert res.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in res.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    plain = complete(cluster, "stream me ", max_tokens=5)
    assert text == plain["choices"][0]["text"]
    chat = {
        "model": cluster.model,
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    with cluster.client.stream("POST", "/v1/chat/completions", json=chat) as res:
        assert res.status_code == 200
        lines = [line for line in res.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3

    # a client that leaves mid-stream: the replica aborts its request and frees its blocks
    def aborted() -> float:
        return sum(v for (name, _), v in cluster.metrics().items() if name == "prefixkv:request_aborted_total")

    before = aborted()
    long = {**body, "max_tokens": 200, "ignore_eos": True}
    with cluster.client.stream("POST", "/v1/completions", json=long) as res:
        next(line for line in res.iter_lines() if line.startswith("data: "))
    cluster.wait_idle()
    assert aborted() == before + 1


def test_same_routes_and_errors_as_one_engine(cluster):
    models = cluster.client.get("/v1/models").json()
    assert models["data"][0]["id"] == cluster.model
    assert cluster.client.get("/health").status_code == 200
    bad = cluster.client.post("/v1/completions", json={"model": cluster.model, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    unknown = cluster.client.post("/v1/completions", json={"model": cluster.model, "prompt": "x", "best_of": 3})
    assert unknown.status_code == 400
    assert cluster.client.post("/v1/completions", content=b"{not json").status_code == 400


def test_outputs_equal_a_single_engine(cluster):
    from prefixkv import LLM, SamplingParams

    prompts = ["the quick brown fox ", "jumps over the lazy dog ", "the quick brown fox jumps"]
    served = [complete(cluster, p, max_tokens=6)["choices"][0]["text"] for p in prompts]
    llm = LLM(model=cluster.model, block_size=BLOCK, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    offline = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))]
    assert served == offline


def test_saturated_replica_sheds_a_hot_prefix(cluster):
    prefix = "hot prefix everyone shares " * 4
    complete(cluster, prefix + "warm")  # one replica caches it
    before = per_engine(cluster, "prefixkv:router_requests_total")

    def one(i):
        body = {
            "model": cluster.model,
            "prompt": prefix + f"q{i}",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with cluster.client.stream("POST", "/v1/completions", json=body) as res:
            return res.status_code, sum(1 for _ in res.iter_lines())

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(status == 200 for status, _ in results)
    after = per_engine(cluster, "prefixkv:router_requests_total")
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert sum(delta.values()) == 8 and min(delta.values()) >= 1, delta  # the hot prefix spread
    cluster.wait_idle()


def lora_keys(cluster) -> list:
    from ray import serve

    from prefixkv.replicas.app import APP_NAME

    return [
        serve.get_deployment_handle(f"engine-{i}", APP_NAME).lora_block_key.remote("qv").result(timeout_s=30)
        for i in range(cluster.args.replicas)
    ]


def test_lora_requests_sharing_a_prefix_land_on_the_replica_caching_them(cluster):
    """The router hashes a LoRA request's blocks with the adapter's block key, as the engine does:
    LoRA requests sharing a prefix go where their blocks are cached (not by load alone)."""
    load = {"lora_name": "qv", "lora_path": cluster.adapter}
    res = cluster.client.post("/v1/load_lora_adapter", json=load)
    assert res.status_code == 200, res.text
    keys = lora_keys(cluster)
    assert keys[0] is not None and keys[0] == keys[1] and keys[0][:3] == ("lora", "qv", cluster.adapter)
    prefix = "an adapter's own conversation: " + "ijklmnop " * 8
    before = per_engine(cluster, "prefixkv:router_requests_total")
    first = complete(cluster, prefix + "one", model="qv")
    assert first["model"] == "qv" and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for i in range(3):
        again = complete(cluster, prefix + f"turn {i}", model="qv")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - 2 * BLOCK
    after = per_engine(cluster, "prefixkv:router_requests_total")
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert sorted(delta.values()) == [0, 4], delta  # all four on the replica caching the prefix
    # the base model's blocks of the same text are others: no hit from the adapter's
    base = complete(cluster, prefix + "one")
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cluster.wait_idle()


def test_the_ingress_imports_no_torch(cluster):
    """The router tokenizes and hashes and never runs the model: its process pays no torch import
    (~3 s of CPU), also after serving requests (the chooser, --kv-tier checks, LoRA hashing)."""
    ray = pytest.importorskip("ray")
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#ingress#" in a["name"]]
    assert len(names) == 1, names
    ingress = ray.get_actor(names[0], namespace="serve")
    loaded = ingress.__ray_call__.remote(lambda _: "torch" in __import__("sys").modules)
    assert ray.get(loaded, timeout=30) is False


# Last in the module: it kills a replica (Serve restarts it, the test waits for that).
def test_killed_replica_is_routed_around_and_rejoins(cluster):
    import time

    prefix = "a conversation on the replica about to die " * 2
    complete(cluster, prefix + "turn one")
    before = per_engine(cluster, "prefixkv:router_requests_total")
    body = {
        "model": cluster.model,
        "prompt": prefix + "long answer",
        "max_tokens": 140,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with cluster.client.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200, res.read()
        lines = res.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        now = per_engine(cluster, "prefixkv:router_requests_total")
        victim = next(k for k in now if now[k] > before.get(k, 0))  # the replica streaming to us
        info = cluster.replica_info()[int(victim)]
        ray = pytest.importorskip("ray")
        ray.kill(ray.get_actor(info["actor_name"], namespace="serve"), no_restart=True)
        # the same prefix again at once: the router may still pick the dead replica; it must retry
        retried = complete(cluster, prefix + "turn two")
        assert retried["choices"][0]["text"]
        rest = [line for line in lines if line.startswith("data: ")]
    # the cut stream ends with an OpenAI error event and [DONE], not a hang (or it had finished)
    assert rest[-1] == "data: [DONE]"
    if len(rest) < 140:
        error = json.loads(rest[-2][6:])
        assert error["error"]["code"] == 503 and "died" in error["error"]["message"]
    assert per_engine(cluster, "prefixkv:router_replica_failures_total")[victim] >= 1
    up = per_engine(cluster, "prefixkv:router_replica_up")
    assert up[victim] == 0 or cluster.replica_info()[int(victim)]["actor_id"] != info["actor_id"]
    blocks = per_engine(cluster, "prefixkv:router_index_blocks")
    if up[victim] == 0:
        assert blocks[victim] == 0  # its blocks are forgotten with it
    # while it is gone, everything lands on the survivor and succeeds
    for i in range(3):
        complete(cluster, prefix + f"turn {i + 3}")
    # Serve restarts it; the router takes it back (a new actor, an empty index entry, new events)
    deadline = time.time() + 90
    while per_engine(cluster, "prefixkv:router_replica_up").get(victim) != 1:
        assert time.time() < deadline, "the killed replica never rejoined"
        time.sleep(0.5)
    assert cluster.replica_info()[int(victim)]["actor_id"] != info["actor_id"]
    # the adapter loaded at run time (the LoRA test) was loaded again into the new replica, before
    # the router took it back, under the same block key as on the survivor
    keys = lora_keys(cluster)
    assert keys[0] is not None and keys[0] == keys[1]
    cluster.wait_idle()


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket of this machine listens on at `port` (/proc/net/tcp{,6})."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr_hex, port_hex = local.split(":")
                if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(addr_hex)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(raw[:width])))
    return found


def test_kv_event_sockets_listen_on_the_server_host_only(cluster):
    """The replicas' KV events carry every prompt's token ids: their PUB and replay sockets were
    bound on tcp://* whatever --host said. They listen on --host (127.0.0.1 here) only, and the
    replica reports the endpoints it bound."""
    assert cluster.args.host == "127.0.0.1"
    for info in cluster.replica_info():
        for port in (info["pub_port"], info["replay_port"]):
            assert _listening(port) == {"127.0.0.1"}, (port, _listening(port))
        assert info["pub_endpoint"] == f"tcp://127.0.0.1:{info['pub_port']}"
        assert info["replay_endpoint"] == f"tcp://127.0.0.1:{info['replay_port']}"
        assert info["events_host"] == "127.0.0.1"
    # and the router still follows the replicas' events (its index is fed through them)
    complete(cluster, list(range(30, 30 + 4 * BLOCK)))
    cluster.wait_idle()
