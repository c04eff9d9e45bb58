"""The decode GEMVs reading some experts from the layer's host bank (`fused_moe_decode(host=)`):
an id -1 - e names expert e of the host bank, an id >= 0 a slot of the device pool, and the output
equals the torch reference over the whole layer. CPU: Triton's interpreter (host and device banks
are both host tensors there, at unrelated addresses); CUDA: a pinned host bank read over the link."""

from __future__ import annotations

import json

import pytest
import torch

from triton_interp import run_interpreted

# The slot pool holds experts 4, 0 and 2 of 6 in slots 0-2.
_SCRIPT = """
import json, torch
from moe_cases import TOL, rel_err, slot_pool
from ferryman.layers.fused_moe_triton import fused_moe_decode
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.layers.moe_common import MoEActivation, host_tables
from ferryman.quant import get_format
E, CACHED = 6, [4, 0, 2]
out = []
# one format per kind of base pointer the kernels offset (_bases): weights and bias (dense), scales
# (mxfp4), zero points and group scales (int4 asym), global scales (nvfp4); GGUF and fp8 read only
# weights and scales. The smallest shapes each loader takes: the interpreter is slow.
for seed, (fmt, kind, dtype, h, i) in enumerate([
    ("dense", "swiglu_oai", torch.float32, 40, 24), ("mxfp4", "silu", torch.float32, 64, 32),
    ("int4:g128:asym", "silu", torch.float32, 128, 128), ("nvfp4", "silu", torch.float32, 64, 32),
]):
    gen = torch.Generator().manual_seed(seed)
    form = get_format(fmt)
    bias = kind == "swiglu_oai"
    banks = form.random_banks(E, h, i, bias, dtype, gen)  # [E, ...] each
    host = slot_pool(form, banks, h, i, bias, dtype)  # expert-major rows, as the host store keeps them
    pool = slot_pool(form, {n: b[CACHED] for n, b in banks.items()}, h, i, bias, dtype)
    t, k = 2, 3
    experts = torch.tensor([[1, 4, 5], [0, 3, 2]], dtype=torch.int32)  # [T, K]: three cached, three not
    slot_of = {e: s for s, e in enumerate(CACHED)}
    ids = torch.tensor([[slot_of.get(e, -1 - e) for e in row] for row in experts.tolist()], dtype=torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    act = MoEActivation(kind)
    ref = fused_moe_reference(form, banks, x, experts, w, act)
    tables = host_tables(fmt, pool, host, x.device)
    got = fused_moe_decode(fmt, pool, x, ids, w, kind, act.alpha, act.limit, host=tables)
    out.append(dict(case=fmt, err=rel_err(got, ref), dtype=str(dtype), tol=TOL[str(dtype)],
                    ok=got.dtype == dtype and got.shape == x.shape))
print(json.dumps(out))
"""


def test_decode_reads_uncached_experts_from_the_host_bank_in_interpreter() -> None:
    cases = json.loads(run_interpreted(_SCRIPT).strip().splitlines()[-1])
    assert [c["case"] for c in cases] == ["dense", "mxfp4", "int4:g128:asym", "nvfp4"]
    for c in cases:
        assert c["ok"] and c["err"] < c["tol"], c


def test_host_table_rejects_banks_of_another_dtype() -> None:
    from ferryman.layers.moe_common import host_table, kernel_bank
    from ferryman.quant import get_format

    form = get_format("dense")
    dev = form.random_banks(2, 32, 16, False, torch.float32, torch.Generator().manual_seed(0))
    host = form.random_banks(4, 32, 16, False, torch.bfloat16, torch.Generator().manual_seed(1))
    x = torch.zeros(1, 32)
    with pytest.raises(ValueError, match="host bank weights: torch.bfloat16 beside the device bank's torch.float32"):
        host_table(kernel_bank("dense", dev, "w13", x), kernel_bank("dense", host, "w13", x))


def test_host_table_rejects_strides_the_kernels_cannot_load_as_vectors() -> None:
    from ferryman.layers.moe_common import host_table, kernel_bank
    from ferryman.quant import get_format

    form = get_format("dense")
    dev = form.random_banks(2, 30, 15, False, torch.float32, torch.Generator().manual_seed(0))
    host = form.random_banks(4, 30, 15, False, torch.float32, torch.Generator().manual_seed(1))  # w13 [4, 30, 30]
    x = torch.zeros(1, 30)
    with pytest.raises(ValueError, match="expert stride 900 elements is not a multiple of 16"):
        host_table(kernel_bank("dense", dev, "w13", x), kernel_bank("dense", host, "w13", x))


def test_host_mode_keeps_16_byte_vector_loads_on_sm90() -> None:
    """The host-read offset carries the 16-element alignment hint (16-byte loads): without it the
    MXFP4 decode kernel's weight loads fell to 4-byte ones, for cached experts too."""
    pytest.importorskip("triton")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from triton_compile_check import compile_check

    from ferryman.layers import fused_moe_triton as fmt

    h = i = 2880
    sig = {"x_ptr": "*bf16", "ids_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*u8", "b_ptr": "*bf16",
           "h_ptr": "*bf16", "alpha": "fp32", "limit": "fp32", "z_ptr": "*u8", "host_ptr": "*i64"}
    cx = {"MXFP4": True, "HAS_BIAS": True, "BLOCK_N": fmt.BLOCK_N, "BLOCK_K": fmt.BLOCK_K, "QF": 0, "QA": 0, "QB": 0,
          "H": h, "I": i, "GGUF": 0, "HOST": True, "W_STRIDE": 5760 * 90 * 16, "S_STRIDE": 5760 * 90,
          "G_STRIDE": 2 * h, "Z_STRIDE": 5760 * 90, "B_STRIDE": 2 * i, "TOPK": 4, "ACT": 1}
    try:
        ptx = compile_check("ferryman.layers.fused_moe_triton:_w13_act_kernel", sig, cx, stage="ptx",
                            divisible=tuple(k for k in sig if k.endswith("_ptr")))
    except (ImportError, RuntimeError) as e:  # no NVIDIA backend in this triton build
        if "backend" in str(e).lower():
            pytest.skip(str(e))
        raise
    assert ptx.count("ld.global.v4.b32") >= 8 and "ld.global.b8" not in ptx


# ---------------------------------------------------------------- CUDA ----------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["mxfp4", "gguf:q4_k:q6_k"])
def test_gpu_decode_reads_pinned_host_experts(fmt: str) -> None:
    """gpt-oss-20b's expert shape (mxfp4) and qwen3-30b-a3b's (Q4_K_M): four of eight pairs read a
    pinned host bank over the link, the rest slots on the GPU; bit for bit the output of the same
    kernel with every expert copied to the GPU first, and inside a CUDA graph too."""
    from ferryman.layers.fused_moe_triton import fused_moe_decode
    from ferryman.layers.moe_common import host_tables
    from ferryman.quant import get_format

    h, i, e, kind = (2880, 2880, 32, "swiglu_oai") if fmt == "mxfp4" else (2048, 768, 128, "silu")
    form = get_format(fmt)
    gen = torch.Generator().manual_seed(0)
    host = {n: b.pin_memory() for n, b in form.random_banks(e, h, i, kind == "swiglu_oai", torch.bfloat16,
                                                             gen).items()}
    dev = {n: b.cuda() for n, b in host.items()}  # every expert, slot = expert id
    experts = torch.tensor([[3, 7, 1, 9, 30, 12, 5, 0]], dtype=torch.int32).cuda()  # [1, 8]
    mixed = torch.where(torch.arange(8, device="cuda") % 2 == 0, experts, -1 - experts).int()
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, 8, device="cuda"), -1)
    want = fused_moe_decode(fmt, dev, x, experts, w, kind, 1.702, 7.0)
    tables = host_tables(fmt, dev, host, x.device)
    got = fused_moe_decode(fmt, dev, x, mixed, w, kind, 1.702, 7.0, host=tables)
    assert torch.equal(got, want)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = fused_moe_decode(fmt, dev, x, mixed, w, kind, 1.702, 7.0, host=tables)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
