"""Several engine replicas behind one prefix-aware, load-gated router, on Ray Serve.

args.py           `prefixkv serve` flags: the replicas' own and the whole serve set (no Ray import)
prompt_hashes.py  a request's prompt -> the block hashes the replicas' KV events name
asgi_bridge.py    one HTTP request through an in-process ASGI app, the response as messages
engine_replica.py EngineReplica: engine + the single-engine app + KV event publisher (a Serve deployment)
event_feed.py     a replica's KV events (ZeroMQ SUB + replay) -> the prefix index
metrics_merge.py  the replicas' Prometheus texts under replica="i"
replica_set.py    ReplicaSet: membership, health polls, LoRA replay to new or restarted replicas
chooser.py        ReplicaChooser: prompt hashes, prefix index and policy (prefixkv/router) -> a replica
ingress.py        Ingress: the OpenAI endpoint over both; retries, broadcasts, health, /metrics
app.py            the Serve application, `serve run` builder, `prefixkv serve --replicas N`
Only args.py is imported by the CLI unless --replicas >= 2: nothing here imports Ray before that.
docs/replicas.md describes the design and the policy's knobs.
"""
