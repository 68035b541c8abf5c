"""A model argument that names nothing on disk fails with a hint: local files only, nothing downloaded."""

import pytest

from prefixkv.model.loader import load_model


def test_hub_id_says_local_only_and_how_to_get_a_local_copy():
    with pytest.raises(FileNotFoundError) as e:
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "Model path does not exist" in msg
    assert "downloads nothing" in msg
    assert "HF model folder" in msg and ".gguf" in msg
    assert "looks like a Hugging Face Hub id" in msg and "--local-dir" in msg


def test_missing_local_path_has_the_hint_but_no_hub_advice(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_model(str(tmp_path / "no-such-model"))
    msg = str(e.value)
    assert "downloads nothing" in msg and "model=None" in msg
    assert "Hub id" not in msg


def test_llm_surfaces_the_hint():
    from prefixkv import LLM

    with pytest.raises(FileNotFoundError, match="downloads nothing"):
        LLM("org/name")
