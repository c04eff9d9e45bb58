"""tools/gguf_random.py: random-weight GGUF files that gguf-py reads back with the types and shapes
asked for, in llama.cpp's Q4_K_M mix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from tiny_models import COMMON, CONFIGS  # noqa: E402

from ferryman.quant.gguf_blocks import dequant_rows  # noqa: E402
from tools.gguf_random import main, use_more_bits  # noqa: E402


def _write(tmp_path: Path, cfg: dict, mix: str, *extra: str) -> "gguf.GGUFReader":
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "m.gguf"
    main(["--preset", str(tmp_path), "--mix", mix, "--out", str(out), *extra])
    return gguf.GGUFReader(out)


def _types(reader: "gguf.GGUFReader") -> dict[str, tuple[str, list[int]]]:
    return {t.name: (t.tensor_type.name.lower(), [int(d) for d in t.shape]) for t in reader.tensors}


def test_use_more_bits_is_llama_cpps_rule() -> None:
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(48) if use_more_bits(i, 48)] == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32,
                                                             35, 38, 41, 42, 43, 44, 45, 46, 47]


def test_q4_k_m_mix_at_k_quant_shapes(tmp_path: Path) -> None:
    cfg = {**COMMON, **CONFIGS["qwen3_moe"], "model_type": "qwen3_moe", "hidden_size": 256,
           "moe_intermediate_size": 256, "num_hidden_layers": 8, "mlp_only_layers": [], "num_experts": 4,
           "vocab_size": 300, "eos_token_id": 299}
    reader = _write(tmp_path, cfg, "q4_k_m", "--layers", "5")
    types = _types(reader)
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.block_count"].contents() == 5
    assert reader.fields["qwen3moe.expert_count"].contents() == 4
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 300
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 299
    for i in range(5):  # gguf-py lists shapes in ggml order: [K, rows, experts]
        down = "q6_k" if i in (0, 3) else "q4_k"  # of 8 layers: 0, 3, 6, 7
        assert types[f"blk.{i}.ffn_down_exps.weight"] == (down, [256, 256, 4])
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == ("q4_k", [256, 256, 4])
        assert types[f"blk.{i}.attn_v.weight"][0] == down
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == ("f32", [256, 4])
        assert types[f"blk.{i}.attn_q_norm.weight"] == ("f32", [16])
    assert "blk.5.attn_q.weight" not in types
    assert types["output.weight"] == ("q6_k", [256, 300]) and types["token_embd.weight"][0] == "q4_k"
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight")
    w = dequant_rows(torch.from_numpy(t.data.copy()), "q4_k")  # [4, 256, 256] sane random values
    assert w.shape == (4, 256, 256) and w.isfinite().all() and 0.03 < w.std().item() < 0.1


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "mixtral", "olmoe"])
def test_tiny_models_fall_back_like_llama_cpp(tmp_path: Path, kind: str) -> None:
    """64-wide rows are no whole Q4_K block: Q5_0 / Q8_0 instead; 8 experts: attn_k/attn_v Q8_0."""
    cfg = {**COMMON, **CONFIGS[kind], "model_type": kind}
    types = _types(_write(tmp_path, cfg, "q4_k_m"))
    i = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    assert types["blk.0.ffn_gate_exps.weight"] == ("q5_0", [64, i, 8])
    whole = i % 32 == 0  # else F16 (mixtral's 48)
    assert types["blk.0.ffn_down_exps.weight"][0] == ("q5_0" if whole else "f16")  # Q4_K
    assert types["blk.2.ffn_down_exps.weight"][0] == ("q8_0" if whole else "f16")  # use_more_bits: Q6_K
    assert types["blk.0.attn_k.weight"][0] == "q8_0" and types["blk.0.attn_output.weight"][0] == "q5_1"
    if kind == "qwen3_moe":  # mlp_only_layers=[1]: a dense FFN
        assert types["blk.1.ffn_gate.weight"] == ("q5_0", [64, 96]) and "blk.1.ffn_gate_exps.weight" not in types
    if kind == "gpt_oss":
        assert types["blk.0.attn_sinks.weight"] == ("f32", [4])
        assert types["blk.0.ffn_down_exps.bias"] == ("f32", [64, 8])


def test_mxfp4_mix(tmp_path: Path) -> None:
    cfg = {**COMMON, **CONFIGS["gpt_oss"], "model_type": "gpt_oss"}
    reader = _write(tmp_path, cfg, "mxfp4")
    types = _types(reader)
    assert types["blk.1.ffn_up_exps.weight"] == ("mxfp4", [64, 64, 8])
    assert types["blk.1.attn_q.weight"][0] == "q8_0" and types["output.weight"][0] == "q8_0"
    assert reader.fields["general.architecture"].contents() == "gpt-oss"


def test_file_tensors_reach_the_formats_without_copies(tmp_path: Path) -> None:
    """What a loader does with the file: rows of a memory-mapped tensor as a torch view, dequantised
    as gguf-py does; a ggml MXFP4 expert tensor repacked losslessly into ferryman's `mxfp4`."""
    import numpy as np

    from ferryman.quant.gguf_blocks import ggml_mxfp4_to_blocks_scales, rows_from_numpy
    from ferryman.quant.mxfp4 import dequant_mxfp4

    cfg = {**COMMON, **CONFIGS["gpt_oss"], "model_type": "gpt_oss"}
    reader = _write(tmp_path, cfg, "mxfp4")
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]  # Q8_0 [64 rows of 64]
    rows = rows_from_numpy(q.data, "q8_0")
    assert rows.shape == (64, 68) and rows.data_ptr() == q.data.ctypes.data
    want = torch.from_numpy(np.array(gguf.quants.dequantize(q.data, q.tensor_type)))
    assert torch.equal(dequant_rows(rows, "q8_0"), want)
    up = tensors["blk.0.ffn_up_exps.weight"]  # MXFP4 [8 experts, 64 rows, 64]
    blocks, scales = ggml_mxfp4_to_blocks_scales(rows_from_numpy(up.data, "mxfp4").view(8, 64, 34))
    want = torch.from_numpy(np.array(gguf.quants.dequantize(up.data, up.tensor_type)))
    assert torch.equal(dequant_mxfp4(blocks, scales, torch.float32), want.view(8, 64, 64))
