"""weights/gguf_reader.py against gguf-py's GGUFReader: the same metadata values, and every tensor's
name, type, shape, offset and memory-mapped data (dtype, shape, bytes), on files of every kind the
tests write (each architecture, float and block types, a tokenizer, nested and typed arrays)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from ferryman.weights.gguf_reader import GGUFFile
from gguf_harmony import build_harmony_gpt_oss, harmony_tokenizer
from gguf_models import byte_tokenizer, mixed, write_gguf
from tiny_models import build_tiny


def same_as_gguf_py(path: Path) -> None:
    ours, ref = GGUFFile(path), GGUFReader(path)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == want
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_elements, b.n_bytes,
                                                                         b.data_offset), a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


@pytest.mark.parametrize("arch,types", [("qwen3_moe", mixed(T.Q8_0, T.Q4_1, T.Q5_0)),
                                        ("qwen3_moe", mixed(T.F16, T.BF16)), ("mixtral", mixed(T.F16, T.F32)),
                                        ("olmoe", mixed(T.IQ4_NL, T.F32))])
def test_model_files_read_as_gguf_py_reads_them(arch: str, types: object, tmp_path: Path) -> None:
    build_tiny(arch, tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(tmp_path / "hf", arch, path, types, extra=byte_tokenizer)  # type: ignore[arg-type]
    same_as_gguf_py(path)


def test_k_quants_of_a_random_q4_k_m_file(tmp_path: Path) -> None:
    """K-quant blocks need 256-wide rows: tools/gguf_random's Q4_K_M mix at such shapes."""
    import json

    from tiny_models import COMMON, CONFIGS
    from tools.gguf_random import main

    cfg = {**COMMON, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "hidden_size": 256,
           "moe_intermediate_size": 256, "num_hidden_layers": 4, "mlp_only_layers": [], "num_experts": 4,
           "vocab_size": 300, "eos_token_id": 299}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    main(["--preset", str(tmp_path), "--mix", "q4_k_m", "--out", str(tmp_path / "m.gguf")])
    same_as_gguf_py(tmp_path / "m.gguf")
    assert {t.tensor_type.name for t in GGUFFile(tmp_path / "m.gguf").tensors} >= {"Q4_K", "Q6_K"}


def test_gpt_oss_with_a_harmony_vocabulary(tmp_path: Path) -> None:
    build_harmony_gpt_oss(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(tmp_path / "hf", "gpt_oss", path, mixed(T.MXFP4, T.BF16), extra=harmony_tokenizer)
    same_as_gguf_py(path)


def test_every_value_type_and_alignment(tmp_path: Path) -> None:
    path = tmp_path / "v.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo"), w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 1.5]), w.add_array("t.strs", ["a", "", "ü"]), w.add_array("t.empty", [])
    w.add_custom_alignment(64)
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.ones((2, 34), dtype=np.uint8), raw_dtype=T.Q8_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    same_as_gguf_py(path)
    f = GGUFFile(path)
    assert f.get_field("t.strs") == ["a", "", "ü"] and f.get_field("t.u64") == 2**40 and f.get_field("nope") is None
    assert all(t.data_offset % 64 == 0 for t in f.tensors)


def test_bad_files_raise_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "v.gguf"
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_array("t.strs", ["x" * 100] * 50)
    w.add_tensor("a", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    data = path.read_bytes()
    for n in (1000, len(data) - 100):  # inside the string array; inside the tensor's bytes
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        with pytest.raises(ValueError, match="cut short"):
            GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(tmp_path / "bad.gguf")
