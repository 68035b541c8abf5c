"""Responses under --replicas: each replica names itself in the ids of the responses it stores,
and the router sends a chained turn (previous_response_id) or a read of a response to that
replica. The id rules here; the cluster run in test_routing.py."""

from __future__ import annotations

import json

from prefixkv.replicas.response_home import replica_of, response_home, response_id_prefix


def test_ids_name_their_replica_and_requests_go_home():
    rid = f"{response_id_prefix(3)}_{'ab' * 16}"
    assert replica_of(rid) == 3
    assert replica_of("resp_" + "ab" * 16) is None  # a single server's id: any replica
    assert replica_of(None) is None and replica_of(7) is None and replica_of("resp_r1_") is None
    body = json.dumps({"input": "and then?", "previous_response_id": rid}).encode()
    assert response_home("POST", "/v1/responses", body) == 3
    assert response_home("POST", "/v1/responses", b'{"input": "hi"}') is None
    assert response_home("POST", "/v1/responses", b"not json") is None
    assert response_home("GET", f"/v1/responses/{rid}", b"") == 3
    assert response_home("DELETE", f"/v1/responses/{rid}", b"") == 3
    assert response_home("POST", "/v1/chat/completions", body) is None
