"""The fast GGUF reader (prefixkv/model/gguf_file.py) against gguf's own GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from prefixkv.model.gguf_file import GGUFFile
from prefixkv.model.loader import default_model_path, dequantize_gguf_tensor, read_gguf_metadata


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return float(a) == float(b) or (np.isnan(a) and np.isnan(b))
    return a == b


def test_default_model_metadata_and_tensors_equal_gguf_reader():
    path = default_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    ref = read_gguf_metadata(theirs)
    assert set(ours.metadata) == set(ref)
    for k, v in ref.items():
        assert type(ours.metadata[k]) is type(v), k
        if isinstance(v, list):
            assert len(v) == len(ours.metadata[k]) and all(_same(a, b) for a, b in zip(ours.metadata[k], v)), k
        else:
            assert _same(ours.metadata[k], v), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    types = set()
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(x) for x in b.shape], a.name
        types.add(a.tensor_type)
        # same bytes, same element type and layout: dequantize_gguf_tensor then gives equal weights
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name
    # and one quantized tensor through the dequantizer, end to end
    q = next(i for i, t in enumerate(ours.tensors) if t.data.dtype == np.uint8)
    np.testing.assert_array_equal(dequantize_gguf_tensor(ours.tensors[q]), dequantize_gguf_tensor(theirs.tensors[q]))
    assert len(types) >= 2  # the default model mixes float32 and quantized tensors


def test_every_value_type_round_trips(tmp_path):
    path = str(tmp_path / "t.gguf")
    w = GGUFWriter(path, "llama")
    w.add_uint8("u8", 7)
    w.add_int8("i8", -7)
    w.add_uint16("u16", 65000)
    w.add_int16("i16", -3000)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -2_000_000_000)
    w.add_float32("f32", 0.1)
    w.add_uint64("u64", 2**63 + 5)
    w.add_int64("i64", -(2**62))
    w.add_float64("f64", 0.1)
    w.add_bool("b", True)
    w.add_string("s", "héllo ✓")
    w.add_array("arr_i", [1, -2, 3])
    w.add_array("arr_f", [0.5, 1.5])
    w.add_array("arr_s", ["a", "", "ünï"])
    w.add_array("arr_b", [True, False, True])
    w.add_tensor("w32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("w16", np.arange(8, dtype=np.float16).reshape(2, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = GGUFFile(path), GGUFReader(path)
    ref = read_gguf_metadata(theirs)
    assert set(ours.metadata) == set(ref)
    for k, v in ref.items():
        got = ours.metadata[k]
        if isinstance(v, list):
            assert len(got) == len(v) and all(_same(a, b) for a, b in zip(got, v)), k
        else:
            assert _same(got, v), (k, got, v)
    assert ours.metadata["s"] == "héllo ✓" and ours.metadata["arr_s"] == ["a", "", "ünï"]
    by_name = {t.name: t for t in ours.tensors}
    assert by_name["w32"].tensor_type == GGMLQuantizationType.F32
    np.testing.assert_array_equal(by_name["w32"].data, np.arange(12, dtype=np.float32).reshape(3, 4))
    np.testing.assert_array_equal(by_name["w16"].data, np.arange(8, dtype=np.float16).reshape(2, 4))


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(open(default_model_path(), "rb").read(4096))
    with pytest.raises(ValueError):
        GGUFFile(str(truncated))
