"""Triton kernels compile for an sm_90 target on this (GPU-less) machine. The interpreter runs the
kernels' Python and misses compile-only errors (a plain global read in a kernel cost one GPU call)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))


@pytest.mark.parametrize("has_idx", [0, 1])
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_mxfp4_dequant_kernel_compiles_for_sm90_with_vector_memory_ops(out: str, has_idx: int) -> None:
    """The dequantiser is memory-bound: each thread loads a scale group's 16 bytes in one vector
    load and stores its 32 values in 16-byte vector stores. (The first version stored every other
    value with 2-byte stores and ran at ~180 GB/s on the H200, 0.28 ms per gpt-oss expert.)"""
    from triton_compile_check import compile_check

    sig = {"blocks_ptr": "*u8", "scales_ptr": "*u8", "idx_ptr": "*i64", "out_ptr": f"*{out}", "slot0": "i64",
           "groups_per_row": "i64", "blocks_row_stride": "i64", "scales_row_stride": "i64"}
    aligned = ("blocks_ptr", "scales_ptr", "idx_ptr", "out_ptr", "groups_per_row", "blocks_row_stride",
               "scales_row_stride")  # what a launch on gpt-oss banks specialises on
    try:
        ptx = compile_check("ferryman.quant.mxfp4_triton:_dequant_kernel", sig, {"GROUPS": 128, "HAS_IDX": has_idx},
                            stage="ptx", divisible=aligned)
    except (ImportError, RuntimeError) as e:  # no NVIDIA backend in this triton build
        if "backend" in str(e).lower():
            pytest.skip(str(e))
        raise
    assert "ld.global.v4.b32" in ptx  # 16 packed bytes at once
    assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx and "st.global.b32 " not in ptx


def _compile_or_skip(qualname: str, sig: dict[str, str], constexprs: dict, stage: str = "ttgir") -> str:
    from triton_compile_check import compile_check

    try:
        return compile_check(qualname, sig, constexprs, stage=stage)
    except (ImportError, RuntimeError) as e:  # no NVIDIA backend in this triton build
        if "backend" in str(e).lower():
            pytest.skip(str(e))
        raise


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_kv_write_and_attention_kernels_compile_for_sm90(cache: str) -> None:
    """The paged-attention kernels with a bf16 cache and with the fp8 (e4m3) one
    (kv_cache_dtype fp8): stores convert to e4m3, loads convert back to q's dtype."""
    strides = lambda *names: {n: "i64" for n in names}  # noqa: E731
    write_sig = {"k": "*bf16", "v": "*bf16", "k_cache": f"*{cache}", "v_cache": f"*{cache}", "slot_mapping": "*i64",
                 **strides("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_kcn", "stride_kcs",
                           "stride_kch", "stride_vcn", "stride_vcs", "stride_vch")}
    ptx = _compile_or_skip("ferryman.layers.paged_attention_triton:_write_kv_kernel", write_sig,
                           {"NUM_KV_HEADS": 8, "H_PAD": 8, "HEAD_DIM": 64, "D_PAD": 64, "BLOCK_SIZE": 16}, stage="ptx")
    assert "st.global" in ptx and (cache != "fp8e4nv" or "cvt.rn.satfinite.e4m3x2" in ptx)  # saturating
    attn_sig = {"out": "*bf16", "part_acc": "*fp32", "part_ml": "*fp32", "q": "*bf16", "k_cache": f"*{cache}",
                "v_cache": f"*{cache}", "sinks": "*fp32", "query_start_loc": "*i32", "seq_lens": "*i32",
                "block_tables": "*i32", "num_seqs": "i32", "num_tokens": "i32", "num_q_heads": "i32",
                "scale_log2": "fp32", "window": "i32", "num_splits": "i32",
                **strides("stride_qt", "stride_qh", "stride_kn", "stride_ks", "stride_kh", "stride_vn", "stride_vs",
                          "stride_vh", "stride_ot", "stride_oh", "stride_bt")}
    cx = {"G": 8, "G_PAD": 8, "BLOCK_M": 16, "BLOCK_N": 64, "HEAD_DIM": 64, "D_PAD": 64, "BLOCK_SIZE": 16,
          "SPLIT": True, "USE_WINDOW": True, "USE_SINKS": True, "DOT_PRECISION": "tf32", "INTERPRET": False}
    ptx = _compile_or_skip("ferryman.layers.paged_attention_triton:_paged_attn_kernel", attn_sig, cx, stage="ptx")
    assert "mma" in ptx and (cache != "fp8e4nv" or "cvt.rn.f16x2.e4m3x2" in ptx)  # e4m3 read back
    merge_sig = {"out": "*bf16", "part_acc": "*fp32", "part_ml": "*fp32", "num_tokens": "i32", "num_q_heads": "i32",
                 **strides("stride_ot", "stride_oh"), "num_splits": "i32"}
    ptx = _compile_or_skip("ferryman.layers.paged_attention_triton:_merge_splits_kernel", merge_sig,
                           {"HEAD_DIM": 64, "D_PAD": 64, "MAX_SPLITS": 64}, stage="ptx")
    assert "ld.global" in ptx and "st.global" in ptx


# int formats at qwen3-30b-a3b shapes (H 2048, I 768): groups of 128, per channel, act-order, 64
# (a group that does not fill a K step)
INT_CASES = {"int4:g128:sym": (4, 128, 0, 0), "int4:g128:asym": (4, 128, 1, 0), "int8:ch:sym": (8, 0, 0, 0),
             "int4:g128:asym:act": (4, 128, 1, 1), "int4:g64:sym": (4, 64, 0, 0)}


@pytest.mark.parametrize(("fmt_name", "host"), [(f, False) for f in ("mxfp4", "dense", *INT_CASES)]
                         + [("mxfp4", True), ("int4:g128:asym:act", True)])
def test_moe_decode_kernels_compile_for_sm90(fmt_name: str, host: bool) -> None:
    """The decode GEMVs with the default tiles, bf16 activations: gpt-oss-20b shapes (mxfp4, dense),
    qwen3-30b-a3b's for the int formats (their tile loader, quant/intq_triton.py); host: with the
    pairs that read their expert from host memory (fused_moe_decode(host=))."""
    from ferryman.layers import fused_moe_triton as fmt
    from ferryman.quant.intq import quant_code

    mxfp4 = fmt_name == "mxfp4"
    q = {"QF": 0, "QA": 0, "QB": 0}
    h, i = (2048, 768) if fmt_name in INT_CASES else (2880, 2880)
    if fmt_name in INT_CASES:
        bits, group, asym, act = INT_CASES[fmt_name]
        w, s, z, g = "*i32", "*fp32", "*u8", "*i32"
        w_stride, s_stride = 2 * i * h * bits // 32, 2 * i * (h // (group or h))
        q = quant_code(bits, group, bool(asym), bool(act))
    else:
        w = s = z = g = "*u8" if mxfp4 else "*bf16"
        w_stride, s_stride = (5760 * 90 * 16, 5760 * 90) if mxfp4 else (5760 * 2880, 5760 * 2880)
    common = {"MXFP4": mxfp4, "HAS_BIAS": True, "BLOCK_N": fmt.BLOCK_N, "BLOCK_K": fmt.BLOCK_K, **q, "H": h, "I": i,
              "GGUF": 0, "HOST": host}
    sig13 = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": w, "s_ptr": s, "g_ptr": g, "b_ptr": "*bf16",
             "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", "z_ptr": z, "host_ptr": "*i64"}
    ptx = _compile_or_skip("ferryman.layers.fused_moe_triton:_w13_act_kernel", sig13,
                           {**common, "W_STRIDE": w_stride, "S_STRIDE": s_stride, "G_STRIDE": 2 * h,
                            "Z_STRIDE": s_stride, "B_STRIDE": 2 * i, "TOPK": 4, "ACT": 1}, stage="ptx")
    assert "ld.global" in ptx and "st.global" in ptx
    sig2 = {"h_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": w, "s_ptr": s, "g_ptr": g, "b_ptr": "*bf16",
            "topk_w_ptr": "*fp32", "y_ptr": "*fp32", "z_ptr": z, "host_ptr": "*i64"}
    ptx = _compile_or_skip("ferryman.layers.fused_moe_triton:_w2_kernel", sig2,
                           {**common, "W_STRIDE": w_stride // 2, "S_STRIDE": s_stride // 2, "G_STRIDE": i,
                            "Z_STRIDE": s_stride // 2, "B_STRIDE": h}, stage="ptx")
    assert "ld.global" in ptx and "st.global" in ptx


@pytest.mark.parametrize("fmt_name", list(INT_CASES))
def test_int_dequant_kernel_compiles_for_sm90(fmt_name: str) -> None:
    """The int dequantiser of the batched prefill path (quant/intq_triton.py), read by row index."""
    bits, group, asym, act = INT_CASES[fmt_name]
    sig = {"q_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8" if asym else "*fp32", "g_ptr": "*i32" if act else "*fp32",
           "idx_ptr": "*i64", "out_ptr": "*bf16", "slot0": "i64", "q_stride": "i64", "s_stride": "i64",
           "z_stride": "i64", "g_stride": "i64"}
    cx = {"OUT": 1536, "K": 2048, "NG": 2048 // (group or 2048), "GS": group or 2048, "PART_ROWS": 768, "BITS": bits,
          "ASYM": asym, "ACT": act, "HAS_IDX": 1, "BLOCK_R": 16, "BLOCK_K": 256}
    ptx = _compile_or_skip("ferryman.quant.intq_triton:_dequant_kernel", sig, cx, stage="ptx")
    assert "ld.global" in ptx and "st.global" in ptx


# the grouped GEMM's pointer types per format: weights, scales, global scales / group indices, zeros
GROUPED_CASES = {"mxfp4": ("*u8", "*u8", "*u8", "*u8"), "dense": ("*bf16",) * 4,
                 "int4:g128:sym": ("*i32", "*fp32", "*i32", "*i32"),
                 "int4:g128:asym:act": ("*i32", "*fp32", "*i32", "*u8"),
                 "int8:ch:asym": ("*i32", "*fp32", "*i32", "*u8"), "int4:g32:sym": ("*i32", "*fp32", "*i32", "*i32"),
                 "fp8:128x128": ("*u8", "*fp32", "*u8", "*u8"), "fp8:channel": ("*u8", "*fp32", "*u8", "*u8"),
                 "nvfp4": ("*u8", "*u8", "*fp32", "*u8"), "nvfp4-ct": ("*u8", "*u8", "*fp32", "*u8"),
                 # scales gathered per input (groups / blocks that do not tile BK): on 2880 x 2880
                 "int8:g24:asym": ("*i32", "*fp32", "*i32", "*u8"), "fp8:32x48": ("*u8", "*fp32", "*u8", "*u8")}


@pytest.mark.parametrize("fmt_name", list(GROUPED_CASES))
def test_grouped_moe_kernels_compile_for_sm90(fmt_name: str) -> None:
    """The grouped GEMM with its default tiles, bf16 activations: packed tiles decoded by each format's
    tile function (gpt-oss-20b's shape for mxfp4 and dense, qwen3-30b-a3b's for the others)."""
    from ferryman.layers.grouped_moe_triton import GroupedConfig
    from ferryman.layers.moe_common import quant_params

    cfg = GroupedConfig()
    w, s, g, z = GROUPED_CASES[fmt_name]
    h, i = (2880, 2880) if fmt_name in ("mxfp4", "dense", "int8:g24:asym", "fp8:32x48") else (2048, 768)
    blocks = {"order_ptr": "*i64", "bslot_ptr": "*i64", "brow_ptr": "*i64", "bend_ptr": "*i64", "w_ptr": w,
              "s_ptr": s, "g_ptr": g, "z_ptr": z, "b_ptr": "*bf16"}
    strides = {name: "i64" for name in ("w_stride", "s_stride", "b_stride", "g_stride", "z_stride")}
    cx = {"H": h, "I": i, "MXFP4": fmt_name == "mxfp4", **quant_params(fmt_name), "HAS_BIAS": True, "FP32": False,
          "BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k}
    sig13 = {"x_ptr": "*bf16", **blocks, "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", **strides}
    ptx = _compile_or_skip("ferryman.layers.grouped_moe_triton:_w13_grouped", sig13, {**cx, "TOPK": 4, "ACT": 1},
                           stage="ptx")
    assert "mma" in ptx
    sig2 = {"h_ptr": "*bf16", **blocks, "tw_ptr": "*fp32", "y_ptr": "*fp32", **strides}
    ptx = _compile_or_skip("ferryman.layers.grouped_moe_triton:_w2_grouped", sig2, cx, stage="ptx")
    assert "mma" in ptx
