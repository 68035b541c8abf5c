"""Several engine replicas behind one prefix-aware, load-gated router, on Ray Serve (issue 14).

args.py           `prefixkv serve --replicas N` flags (no Ray import)
prompt_hashes.py  a request's prompt -> the block hashes the replicas' KV events name
asgi_bridge.py    one HTTP request through an in-process ASGI app, the response as messages
engine_replica.py EngineReplica: engine + the single-engine app + KV event publisher (a Serve deployment)
event_feed.py     a replica's KV events (ZeroMQ SUB + replay) -> the router's PrefixIndex
metrics_merge.py  the replicas' Prometheus texts under replica="i"
ingress.py        Ingress: the OpenAI endpoint, routing (prefixkv/router), retries, health, /metrics
app.py            the Serve application, `serve run` builder, `prefixkv serve --replicas N`
Only args.py is imported by the CLI unless --replicas >= 2: nothing here imports Ray before that.
docs/replicas.md describes the design and the policy's knobs.
"""
