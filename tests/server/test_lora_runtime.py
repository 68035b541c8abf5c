"""Runtime LoRA updating, in-process: the load / unload routes exist
only when allowed (as vLLM), every refused path gets one answer (the reason only in the log),
--lora-allowed-dir cannot be escaped; a loaded adapter keeps serving after its folder is deleted,
and files overwritten with the same size and mtime still load anew (content hash, not stat)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
from starlette.testclient import TestClient

from prefixkv import LLM, SamplingParams
from prefixkv.lora import LoRARequest
from prefixkv.server.app import create_app
from prefixkv.server.lora import REFUSED_PATH

from ..lora.conftest import ADAPTERS, Fixture, peft_greedy, write_adapter

MAX_NEW = 4


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return Fixture("llama", tmp_path_factory.mktemp("lora-runtime"))


@pytest.fixture(scope="module")
def engine(fx):
    llm = LLM(
        str(fx.base), dtype="float32", device="cpu", num_blocks=32, block_size=8, enable_lora=True, max_lora_rank=8
    )
    return llm.llm_engine


def _load(c, name, path):
    return c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def _complete(c, model, prompt):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    return c.post("/v1/completions", json=body)


def test_runtime_routes_exist_only_when_allowed(engine, fx, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    off = TestClient(create_app(engine, engine_thread=False))  # no lifespan: routes only
    assert _load(off, "x", fx.adapters["qv"]).status_code == 404
    assert off.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    for value, on in (("1", True), ("TRUE", True), ("true", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        c = TestClient(create_app(engine, engine_thread=False))
        # the route answers (404 here = no such adapter, not no such route)
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 404 and (("cannot be found" in r.text) == on), value
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    flag = TestClient(create_app(engine, engine_thread=False, allow_runtime_lora_updating=True))
    assert "cannot be found" in flag.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).text


def test_runtime_on_without_api_key_warns(engine, caplog):
    with caplog.at_level(logging.WARNING, logger="prefixkv.server"):
        create_app(engine, engine_thread=False, allow_runtime_lora_updating=True)
    assert any("without --api-key" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixkv.server"):
        create_app(engine, engine_thread=False, allow_runtime_lora_updating=True, api_key="k")
    assert not any("without --api-key" in r.getMessage() for r in caplog.records)


def test_refused_paths_get_one_answer_and_the_allowed_dir_holds(engine, fx, tmp_path, caplog):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copytree(fx.adapters["qv"], allowed / "good")
    (allowed / "empty").mkdir()
    (allowed / "file").write_text("x")
    (allowed / "escape").symlink_to(fx.adapters["qv"])  # a real adapter, outside
    refused = [
        allowed / "missing",
        allowed / "file",
        allowed / "empty",
        allowed / "escape",
        f"{allowed}/../../{os.path.relpath(fx.adapters['qv'], tmp_path.parent)}",
        fx.adapters["qv"],  # a valid adapter outside the allowed folder
        "/root",
        "/no/such/dir",
    ]
    app = create_app(engine, allow_runtime_lora_updating=True, lora_allowed_dir=str(allowed))
    with TestClient(app) as c, caplog.at_level(logging.WARNING, logger="prefixkv.server"):
        bodies = set()
        for i, path in enumerate(refused):
            r = _load(c, f"bad{i}", path)
            assert r.status_code == 400, (path, r.text)
            bodies.add(r.text)
        assert len(bodies) == 1 and REFUSED_PATH in bodies.pop()
        logged = [rec.getMessage() for rec in caplog.records if "load_lora_adapter" in rec.getMessage()]
        assert len(logged) == len(refused), logged  # the details: in the log only
        assert _load(c, "good", allowed / "good").status_code == 200
        assert _complete(c, "good", fx.prompts[0]).status_code == 200
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_unreadable_config_gets_the_same_answer(engine, fx, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = tmp_path / "locked"
    shutil.copytree(fx.adapters["qv"], path)
    os.chmod(path / "adapter_config.json", 0)
    c = TestClient(create_app(engine, engine_thread=False, allow_runtime_lora_updating=True))
    r = _load(c, "locked", path)
    assert r.status_code == 400 and REFUSED_PATH in r.text


def test_loaded_adapter_survives_its_folder_deleted(engine, fx, tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(fx.adapters["qv"], path)
    prompt = fx.prompts[1]
    with TestClient(create_app(engine, allow_runtime_lora_updating=True)) as c:
        assert _load(c, "gone", path).status_code == 200
        first = _complete(c, "gone", prompt)
        assert first.status_code == 200, first.text
        shutil.rmtree(path)
        again = _complete(c, "gone", prompt)
        assert again.status_code == 200, again.text  # was 400 "does not exist"
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert "gone" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def _overwrite_same_stat(fx, path, seed):
    """New weights in `path` with the sizes and mtimes of the files they replace."""
    stats = {f: os.stat(path / f) for f in os.listdir(path)}
    tmp = path.parent / f"new-{seed}"
    write_adapter(fx.base, tmp, seed=seed, **ADAPTERS["qv"])
    for f, st in stats.items():
        shutil.copyfile(tmp / f, path / f)
        assert os.path.getsize(path / f) == st.st_size, f  # same size: only the content differs
        os.utime(path / f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_same_size_and_mtime_overwrite_loads_the_new_weights_offline(fx, tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(fx.adapters["qv"], path)
    llm = LLM(
        str(fx.base), dtype="float32", device="cpu", num_blocks=32, block_size=8, enable_lora=True, max_lora_rank=8
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    lora = LoRARequest("x", 1, str(path))
    prompt = fx.prompts[2]

    def gen():
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    assert gen()[0] == 0
    assert gen()[0] > 0
    _overwrite_same_stat(fx, path, seed=4242)
    cached, tokens = gen()
    assert tokens == peft_greedy(fx.base, str(path), [prompt], MAX_NEW)[0]  # the new weights
    assert cached == 0  # and none of the old weights' blocks
    engine = llm.llm_engine
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_server_reload_after_same_stat_overwrite(engine, fx, tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(fx.adapters["qv"], path)
    prompt = fx.prompts[0]
    with TestClient(create_app(engine, allow_runtime_lora_updating=True)) as c:
        assert _load(c, "r", path).status_code == 200
        old = _complete(c, "r", prompt).json()
        assert _complete(c, "r", prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "r"}).status_code == 200
        _overwrite_same_stat(fx, path, seed=777)
        assert _load(c, "r", path).status_code == 200
        new = _complete(c, "r", prompt).json()
        assert new["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        expected = peft_greedy(fx.base, str(path), [prompt], MAX_NEW)[0]
        assert new["choices"][0]["text"] == engine.tokenizer.decode(expected)
        assert old["choices"][0]["text"] != new["choices"][0]["text"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "r"}).status_code == 200
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_runtime_lora_flags_without_their_feature_are_refused_by_name(monkeypatch, tmp_path):
    """--allow-runtime-lora-updating without --enable-lora, and --lora-allowed-dir without runtime
    updating, would change nothing: `prefixkv serve` refuses them, naming the flag."""
    from prefixkv.cli import build_parser
    from prefixkv.server.launch import check_server_args

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)

    def check(*flags: str) -> None:
        check_server_args(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(SystemExit, match="--allow-runtime-lora-updating needs --enable-lora"):
        check("--allow-runtime-lora-updating")
    with pytest.raises(SystemExit, match="--lora-allowed-dir needs runtime LoRA updating"):
        check("--enable-lora", "--lora-allowed-dir", str(tmp_path))
    check("--enable-lora", "--allow-runtime-lora-updating", "--lora-allowed-dir", str(tmp_path))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    check("--enable-lora", "--lora-allowed-dir", str(tmp_path))
