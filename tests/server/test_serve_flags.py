"""vLLM's `serve` flags against a started server: TLS (a self-signed certificate made here),
--root-path, CORS, --response-role, --return-tokens-as-token-ids, request logging, and a --config
YAML file whose flags the command line overrides. One server start for all of them."""

from __future__ import annotations

import datetime
import json
import os
import ssl

import httpx
import pytest

from .conftest import Server

ORIGIN = "https://app.example"


def _self_signed(folder: str) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 (cryptography's x509 builder)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefixkv test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tls"))
    key, cert = _self_signed(folder)
    config = os.path.join(folder, "serve.yaml")
    with open(config, "w") as f:
        # max-model-len is on the command line too (conftest's 1024): the command line wins
        f.write(
            "max-model-len: 512\n"
            "served-model-name: [from-config]\n"
            "response-role: from-config\n"
            f"allowed-origins: ['{ORIGIN}']\n"
            "allowed-methods: [GET, POST]\n"
            "enable-log-requests: true\n"
            "max-log-len: 12\n"
            "load-format: gguf\n"
            "tokenizer-mode: auto\n"
            f"download-dir: {folder}\n"
            "enable-prompt-tokens-details: true\n"
        )
    s = Server(
        "--config",
        config,
        "--response-role",
        "narrator",
        "--return-tokens-as-token-ids",
        "--root-path",
        "/llm",
        "--ssl-keyfile",
        key,
        "--ssl-certfile",
        cert,
        scheme="https",
        verify=ssl.create_default_context(cafile=cert),
    )
    yield s
    s.stop()


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.base, verify=server.verify, timeout=60)


def test_tls_serves_https_and_refuses_plain_http(server):
    assert server.base.startswith("https://")
    with _client(server) as c:
        assert c.get("/health").status_code == 200
    with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
        httpx.get(server.base + "/health", timeout=10)
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base.replace("https://", "http://") + "/health", timeout=10)


def test_config_file_flags_apply_and_the_command_line_wins(server):
    with _client(server) as c:
        card = c.get("/v1/models").json()["data"][0]
    assert card["id"] == "from-config"  # from the file
    assert card["max_model_len"] == 1024  # the command line's, over the file's 512


def test_root_path_routes_answer_with_and_without_the_prefix(server):
    with _client(server) as c:
        for path in ("/llm/v1/models", "/v1/models", "/llm/health"):
            assert c.get(path).status_code == 200, path
        assert c.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_cors_answers_the_allowed_origin_only(server):
    with _client(server) as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        bad = c.options(
            "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        got = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert got.headers["access-control-allow-origin"] == ORIGIN


def test_response_role_and_request_log(server):
    prompt = "Say something about rivers and mountains."
    body = {"model": "from-config", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    with _client(server) as c:
        r = c.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "narrator"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: "))
        assert '"role":"narrator"' in first.replace(" ", "")
        # continuing the final message: the reply keeps that message's role (vLLM's rule)
        cont = {
            **body,
            "messages": [*body["messages"], {"role": "assistant", "content": "Rivers"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
        r = c.post("/v1/chat/completions", json=cont)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        c.post("/v1/completions", json={"model": "from-config", "prompt": "0123456789abcdefghij", "max_tokens": 2})
    log = server.output()
    lines = [line for line in log.splitlines() if "Received request cmpl-" in line]
    assert len(lines) == 1, log
    assert "prompt: '0123456789ab'," in lines[0]  # cut to --max-log-len 12 characters
    assert "max_tokens=2" in lines[0]
    chats = [line for line in log.splitlines() if "Received request chatcmpl-" in line]
    assert len(chats) == 3
    assert all("prompt: '<|im_start|>'," in line for line in chats)  # the rendered ids, special tokens kept
    assert "--enable-prompt-tokens-details" in log  # accepted, and said so


def test_logprobs_name_tokens_by_id_unless_a_request_says_otherwise(server):
    """--return-tokens-as-token-ids: every token of the logprobs is `token_id:N` (a chosen chat
    token keeps its text's bytes, as vLLM's); completions' offsets count those strings; a request's
    return_tokens_as_token_ids false gives the texts back."""
    chat = {
        "model": "from-config",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }
    done = {"model": "from-config", "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    with _client(server) as c:
        r = c.post("/v1/chat/completions", json=chat).json()
        ids = r["choices"][0]["token_ids"]
        content = r["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        assert all(x["token"].startswith("token_id:") for e in content for x in e["top_logprobs"])
        assert content[0]["top_logprobs"][0]["token"] == content[0]["token"]  # greedy: the top one
        as_text = c.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": False}).json()
        texts = [e["token"] for e in as_text["choices"][0]["logprobs"]["content"]]
        assert "".join(texts) == as_text["choices"][0]["message"]["content"]
        assert [e["bytes"] for e in content] == [list(t.encode()) for t in texts]
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        streamed = [
            e["token"] for ch in chunks for x in ch["choices"] for e in (x.get("logprobs") or {}).get("content") or []
        ]
        assert streamed == [f"token_id:{t}" for t in ids]
        r = c.post("/v1/completions", json={**done, "echo": True, "return_token_ids": True}).json()["choices"][0]
        lp, prompt_ids = r["logprobs"], r["prompt_token_ids"]
        assert lp["tokens"] == [f"token_id:{t}" for t in prompt_ids + r["token_ids"]]
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
        plain = c.post("/v1/completions", json={**done, "return_tokens_as_token_ids": False}).json()["choices"][0]
        assert "".join(plain["logprobs"]["tokens"]) == plain["text"]
