"""fp8 (e4m3) KV cache: kv_cache_dtype="fp8" halves the cache's bytes; attention reads it back."""

from __future__ import annotations

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.config import EngineConfig, kv_dtype
from ferryman.plan_report import describe_plan
from ferryman.errors import ConfigError
from ferryman.layers.paged_attention import AttnMetadata, FP8_KV, paged_attention_reference, write_kv_reference


def _one_sequence(gen: torch.Generator, t: int = 40, hq: int = 4, hkv: int = 2, d: int = 16, blocks: int = 4,
                  size: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttnMetadata, tuple]:
    q = torch.randn(t, hq, d, generator=gen).bfloat16()
    k = (3 * torch.randn(t, hkv, d, generator=gen)).bfloat16()
    v = torch.randn(t, hkv, d, generator=gen).bfloat16()
    meta = AttnMetadata(query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                        seq_lens=torch.tensor([t], dtype=torch.int32),
                        block_tables=torch.tensor([[2, 0, 3, 1]], dtype=torch.int32),
                        slot_mapping=torch.tensor([[2, 0, 3, 1][p // size] * size + p % size for p in range(t)]),
                        max_query_len=t, max_seq_len=t)
    return q, k, v, meta, (blocks, size, hkv, d)


def test_fp8_cache_stores_the_saturated_cast_and_attends_close_to_bf16() -> None:
    q, k, v, meta, shape = _one_sequence(torch.Generator().manual_seed(1))
    big = k.clone()
    big[0, 0, 0] = -1000.0  # beyond e4m3's 448: stored as -448, not NaN
    kc, vc = torch.zeros(shape, dtype=FP8_KV), torch.zeros(shape, dtype=FP8_KV)
    write_kv_reference(big, v, kc, vc, meta.slot_mapping)
    assert kc[2, 0, 0, 0].float().item() == -448.0
    assert torch.equal(kc[2, 1].float(), k[1].to(FP8_KV).float())  # position 1: block 2, offset 1
    outs = {}
    for dtype in (torch.bfloat16, FP8_KV):
        kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        write_kv_reference(k, v, kc, vc, meta.slot_mapping)
        outs[dtype] = paged_attention_reference(q, kc, vc, meta, 16**-0.5, window=8, sinks=torch.zeros(4))
    assert outs[FP8_KV].dtype == torch.bfloat16 and torch.isfinite(outs[FP8_KV]).all()
    a, b = outs[FP8_KV].float(), outs[torch.bfloat16].float()
    rel = ((a - b).norm() / b.norm()).item()
    assert 0 < rel < 0.05, rel  # e4m3 keeps 3 mantissa bits (~3% per value): close, not equal


def test_kv_dtype_choices_and_errors() -> None:
    assert kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_dtype("fp8", torch.bfloat16) == FP8_KV
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8"):
        kv_dtype("int4", torch.bfloat16)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, got 'fp16'"):
        EngineConfig(model="x", kv_cache_dtype="fp16")


def test_engine_with_fp8_kv_plans_half_the_bytes_and_scores_close() -> None:
    """The demo model on the CPU: the cache tensors are fp8, the plan counts 1 byte per value, and
    the logits of a prompt stay near the bf16 cache's. The chat-tuned demo model is sensitive to
    e4m3's 3 mantissa bits (2026-12-01: top token agrees at 0.70 of positions, logits 0.20 apart
    relative; an all-zero or unrelated cache agrees far less)."""
    kw = dict(device="cpu", dtype="bfloat16", max_num_seqs=2, max_model_len=256, gpu_memory="1GiB")
    ref, fp8 = LLM(**kw), LLM(kv_cache_dtype="fp8", **kw)
    attn = fp8.engine.runner.model.attention_layers()[0]
    assert attn.k_cache is not None and attn.k_cache.dtype == FP8_KV and attn.v_cache.dtype == FP8_KV
    assert fp8.engine.plan.request.kv_per_token * 2 == ref.engine.plan.request.kv_per_token
    assert "stored as float8_e4m3fn" in describe_plan(fp8.engine.plan)
    ids = ref.encode("def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n")
    a, b = ref.score([ids])[0], fp8.score([ids])[0]  # [L, V]
    assert not torch.equal(a, b)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    rel = ((a.float() - b.float()).norm() / a.float().norm()).item()
    assert agree >= 0.6 and rel < 0.3, (agree, rel)
    out = fp8.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


_INTERPRETED = """
import torch
from tests.test_paged_attention import MIXED, make_batch
from ferryman.layers.paged_attention import paged_attention_reference, FP8_KV
from ferryman.layers.paged_attention_triton import paged_attention_triton
b = make_batch(MIXED, pad_tokens=2, seed=11)
kc, vc = b.k_cache.to(FP8_KV), b.v_cache.to(FP8_KV)
sinks = torch.randn(8)
for window, splits in ((8, 1), (None, 2)):
    out = paged_attention_triton(b.q, kc, vc, b.meta, 0.3, window, sinks, splits)
    ref = paged_attention_reference(b.q, kc, vc, b.meta, 0.3, window, sinks)
    torch.testing.assert_close(out[: b.num_real], ref[: b.num_real], atol=1e-4, rtol=1e-4)
# (the write kernel's e4m3 cast is checked on the GPU only: the interpreter's emulation of it
# rounds some mantissa carries wrongly, e.g. 1.97 -> 1.0 where the hardware and torch give 2.0)
print("FP8-OK")
"""


def test_triton_attention_reads_an_fp8_cache_under_the_interpreter() -> None:
    from triton_interp import run_interpreted

    assert run_interpreted(_INTERPRETED).strip().endswith("FP8-OK")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_kv_triton_equals_the_reference_on_the_same_cache() -> None:
    """The Triton kernels write the same fp8 bytes as the reference and attend to within rounding."""
    from ferryman.layers.paged_attention_triton import paged_attention_triton, write_kv_triton

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability >= 8.9")
    q, k, v, meta, shape = _one_sequence(torch.Generator().manual_seed(2))
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    meta = AttnMetadata(*(t.cuda() for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                             meta.slot_mapping)), meta.max_query_len, meta.max_seq_len)
    kc, vc = torch.zeros(shape, dtype=FP8_KV, device="cuda"), torch.zeros(shape, dtype=FP8_KV, device="cuda")
    write_kv_triton(k, v, kc, vc, meta.slot_mapping)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    write_kv_reference(k, v, kr, vr, meta.slot_mapping)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8)) and torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    got = paged_attention_triton(q, kc, vc, meta, 16**-0.5, 8, torch.zeros(4, device="cuda"))
    want = paged_attention_reference(q, kc, vc, meta, 16**-0.5, 8, torch.zeros(4, device="cuda"))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
