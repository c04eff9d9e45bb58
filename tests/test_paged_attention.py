"""Paged attention: torch reference vs independent dense attention and transformers' eager
attention (gpt-oss sinks + sliding window masks); Triton kernel vs the reference under
TRITON_INTERPRET=1 (in a subprocess) and on CUDA (gpu marker)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from ferryman.layers.paged_attention import AttnMetadata, paged_attention, paged_attention_reference, write_kv

REPO = Path(__file__).resolve().parents[1]
# (seq_len after the step, query tokens this step): chunked prefill, decode, full prefill, tiny
MIXED = [(45, 6), (17, 1), (70, 30), (3, 3), (33, 1)]


@dataclass
class Batch:
    q: Tensor  # [T, Hq, D] (T may include padding tokens past query_start_loc[-1])
    k_cache: Tensor  # [N, S, Hkv, D]
    v_cache: Tensor
    meta: AttnMetadata
    keys: list[Tensor]  # per sequence [L, Hkv, D], the full kv in position order
    values: list[Tensor]
    num_real: int  # tokens that belong to a sequence


def make_batch(
    specs: list[tuple[int, int]],
    *,
    hq: int = 8,
    hkv: int = 2,
    d: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> Batch:
    """Caches hold the cached prefix (written here by hand); the new tokens go in via write_kv."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)  # shuffled block ids; the spares keep garbage
    k_cache, v_cache = randn(num_blocks, block_size, hkv, d), randn(num_blocks, block_size, hkv, d)
    block_tables = torch.full((len(specs), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    keys, values, new_k, new_v, slots = [], [], [], [], []
    used = 0
    for b, ((seq_len, qlen), nblk) in enumerate(zip(specs, blocks_per_seq)):
        block_tables[b, :nblk] = perm[used : used + nblk].int()
        used += nblk
        keys.append(randn(seq_len, hkv, d))
        values.append(randn(seq_len, hkv, d))
        pos = torch.arange(seq_len)
        blk, off = block_tables[b, pos // block_size].long(), pos % block_size
        cached = seq_len - qlen
        k_cache[blk[:cached], off[:cached]] = keys[b][:cached]
        v_cache[blk[:cached], off[:cached]] = values[b][:cached]
        new_k.append(keys[b][cached:])
        new_v.append(values[b][cached:])
        slots.append(blk[cached:] * block_size + off[cached:])
    num_real = sum(q for _, q in specs)
    new_k.append(randn(pad_tokens, hkv, d))
    new_v.append(randn(pad_tokens, hkv, d))
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.long))
    qlens = torch.tensor([q for _, q in specs])
    meta = AttnMetadata(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)]).int().to(device),
        seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(s for s, _ in specs),
    )
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    write_kv(torch.cat(new_k).to(device), torch.cat(new_v).to(device), k_cache, v_cache, meta.slot_mapping)
    q = randn(num_real + pad_tokens, hq, d).to(device)
    return Batch(q, k_cache, v_cache, meta, keys, values, num_real)


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None, sinks: Tensor | None
) -> Tensor:
    """Written independently: each query slices the keys it sees, explicit exp/sum with the sink."""
    num_q, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    kf = k.double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
    vf = v.double().repeat_interleave(hq // hkv, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(num_q):
        pos = seq_len - num_q + i
        lo = 0 if window is None else max(0, pos - window + 1)
        s = torch.einsum("hd,khd->hk", q[i].double(), kf[lo : pos + 1]) * scale  # [Hq, keys]
        m = s.max(dim=1).values
        if sinks is not None:
            m = torch.maximum(m, sinks.double())
        e = torch.exp(s - m[:, None])
        denom = e.sum(dim=1) + (torch.exp(sinks.double() - m) if sinks is not None else 0.0)
        out[i] = torch.einsum("hk,khd->hd", e / denom[:, None], vf[lo : pos + 1])
    return out


def seq_queries(batch: Batch, b: int) -> Tensor:
    starts = batch.meta.query_start_loc.tolist()
    return batch.q[starts[b] : starts[b + 1]]


# ----------------------------------------------------------------------------- write_kv


def test_write_kv_stores_at_slots_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([13, -1, 2, 23, -1])
    write_kv(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], k[t])
            assert torch.equal(v_cache[slot // 4, slot % 4], v[t])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 3  # nothing else was written


def test_make_batch_cache_holds_every_sequence() -> None:
    batch = make_batch(MIXED, pad_tokens=2)
    block_size = batch.k_cache.shape[1]
    for b, (seq_len, _) in enumerate(MIXED):
        pos = torch.arange(seq_len)
        blk = batch.meta.block_tables[b, pos // block_size].long()
        assert torch.equal(batch.k_cache[blk, pos % block_size], batch.keys[b])
        assert torch.equal(batch.v_cache[blk, pos % block_size], batch.values[b])


# ----------------------------------------------------------------------------- reference


# the reference, and `paged_attention` on the CPU: torch's flash attention for prompt rows
# (layers/paged_attention_torch.py), the reference for decode rows
PATHS = [pytest.param(paged_attention_reference, id="reference"), pytest.param(paged_attention, id="cpu-flash")]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attend", PATHS)
def test_reference_matches_dense(window: int | None, use_sinks: bool, dtype: torch.dtype,
                                 attend) -> None:  # noqa: ANN001
    batch = make_batch(MIXED, dtype=dtype, pad_tokens=3, seed=2)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2 if use_sinks else None
    out = attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.3, window, sinks)
    assert out.shape == batch.q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in range(len(MIXED)):
        expect = dense_attention(seq_queries(batch, b), batch.keys[b], batch.values[b], 0.3, window, sinks)
        starts = batch.meta.query_start_loc.tolist()
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), expect, atol=tol, rtol=tol)


def hf_mask(seq_len: int, num_q: int, window: int | None) -> Tensor:
    """transformers' eager mask of gpt-oss for the last num_q queries of a seq_len sequence."""
    from transformers import GptOssConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = GptOssConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_hidden_layers=2, sliding_window=window or 128,
    )
    config._attn_implementation = "eager"
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    # a query's mask row does not depend on the other queries: take the last rows of the full mask
    full = make(config=config, inputs_embeds=torch.zeros(1, seq_len, 16), attention_mask=None, cache=None)
    return full[:, :, seq_len - num_q :, :]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("attend", PATHS)
def test_reference_matches_transformers_eager(window: int | None, use_sinks: bool, attend) -> None:  # noqa: ANN001
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

    batch = make_batch(MIXED, pad_tokens=1, seed=4)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2 if use_sinks else None
    out = attend(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, window, sinks)
    module = SimpleNamespace(num_key_value_groups=4, sinks=sinks, training=False)
    eager = gpt_oss_eager if use_sinks else llama_eager
    starts = batch.meta.query_start_loc.tolist()
    for b, (seq_len, num_q) in enumerate(MIXED):
        query = seq_queries(batch, b).transpose(0, 1)[None]  # [1, Hq, Q, D]
        key, value = batch.keys[b].transpose(0, 1)[None], batch.values[b].transpose(0, 1)[None]
        expect, _ = eager(module, query, key, value, hf_mask(seq_len, num_q, window), scaling=0.25)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expect[0], atol=1e-5, rtol=1e-5)


def test_reference_long_prefill_is_chunked_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    import ferryman.layers.paged_attention as pa

    batch = make_batch([(50, 40)], seed=6)
    whole = pa.paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, 8, None)
    monkeypatch.setattr(pa, "_REF_MAX_SCORE_ELEMS", 8 * 50 * 7)  # 7 queries per chunk
    chunked = pa.paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2, 8, None)
    torch.testing.assert_close(chunked, whole, atol=0, rtol=0)


@pytest.mark.parametrize("window", [None, 8, 700])
def test_cpu_flash_on_long_prompts_matches_the_reference(window: int | None) -> None:
    """Prompt rows past several windowed query blocks (WINDOW_BLOCK = 256) after a cached prefix, and
    a window longer than a block; two sequences, sinks: within fp32 rounding of the reference."""
    batch = make_batch([(900, 600), (300, 300)], hq=4, hkv=1, d=16, seed=11)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(12))
    want = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, window, sinks)
    got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.25, window, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_dispatch_uses_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch(MIXED[:2], seed=7)
    expect = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2)
    torch.testing.assert_close(paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.2), expect)
    from triton_interp import use_kernels  # here: the interpreter script imports this module

    from ferryman.errors import ConfigError

    with pytest.raises(ConfigError, match="FERRYMAN_KERNELS='cuda-magic' is invalid"):
        use_kernels(monkeypatch, "cuda-magic")  # a bad value fails where it is read, once


def test_bad_inputs_raise_value_errors() -> None:
    batch = make_batch(MIXED[:2], seed=8)
    q, kc, vc, meta = batch.q, batch.k_cache, batch.v_cache, batch.meta
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :3], kc, vc, meta, 0.2)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(q[..., :16], kc, vc, meta, 0.2)
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kc, vc, meta, 0.2, window=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(q, kc, vc, meta, 0.2, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.double(), kc, vc, meta, 0.2)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(q[:, :2], q[:, :2], kc, vc, meta.slot_mapping[:1])


# ----------------------------------------------------------------------------- Triton, interpreter

# Runs in a subprocess so TRITON_INTERPRET=1 does not leak into this process. CPU tensors.
# bf16 is left out: the 3.6 interpreter's tl.dot gives garbage on bf16 (checked by hand).
_INTERPRETER_SCRIPT = """
import torch
from tests.test_paged_attention import MIXED, make_batch
from ferryman.layers.paged_attention import paged_attention, paged_attention_reference, write_kv_reference
from ferryman.layers.paged_attention_triton import paged_attention_triton, write_kv_triton

def check(batch, window, sinks, splits, scale=0.3):
    out = paged_attention_triton(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, sinks, splits)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, sinks)
    n = batch.num_real
    tol = 1e-4 if batch.q.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[:n], ref[:n], atol=tol, rtol=tol)

sinks8 = torch.randn(8) * 2
mixed = make_batch(MIXED, pad_tokens=2, seed=11)
for window, sinks, splits in [(None, None, 1), (8, sinks8, 1), (None, sinks8, 4), (8, None, 2)]:
    check(mixed, window, sinks, splits)
# long sequences: kv blocks that need no mask (causal, and inside a window of 100)
long = make_batch([(300, 5), (260, 1), (200, 70)], hq=4, hkv=1, d=16, seed=14)
for window, splits in [(None, 1), (100, 1), (100, 2), (None, 64)]:  # 64: most splits see no key
    check(long, window, torch.randn(4), splits)
# decode only (max_query_len 1), gpt-oss-like group of 8, block table entries of 4 tokens
decode = make_batch([(37, 1), (5, 1), (64, 1)], hq=16, hkv=2, d=16, block_size=4, seed=12, pad_tokens=1)
check(decode, 8, torch.randn(16), 1)
check(decode, None, torch.randn(16), 4)
# group of 3 (padded to 4), head_dim 24 (padded to 32), fp16
odd = make_batch([(40, 9), (20, 20)], hq=6, hkv=2, d=24, dtype=torch.float16, seed=13)
check(odd, 5, torch.randn(6), 2)
# q as a strided view (a slice of a fused qkv projection)
fused = torch.randn(mixed.q.shape[0], 8 + 4, 32)
mixed.q = fused[:, :8]
check(mixed, 8, sinks8, 1)
# the public entry point on CPU tensors, forced to Triton
import os
os.environ["FERRYMAN_KERNELS"] = "triton"
out = paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, 0.3, 8, sinks8)
ref = paged_attention_reference(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, 0.3, 8, sinks8)
torch.testing.assert_close(out[: mixed.num_real], ref[: mixed.num_real], atol=1e-4, rtol=1e-4)
# write_kv kernel, padding slots skipped, strided k
caches = [torch.zeros(5, 4, 2, 8) for _ in range(4)]
kv = torch.randn(6, 4, 8)
slots = torch.tensor([3, -1, 17, 0, -1, 9])
write_kv_triton(kv[:, :2], kv[:, 2:], caches[0], caches[1], slots)
write_kv_reference(kv[:, :2], kv[:, 2:], caches[2], caches[3], slots)
assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
print("INTERPRETER-OK")
"""


def test_triton_interpreter_matches_reference() -> None:
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path)
    env.pop("FERRYMAN_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_INTERPRETER_SCRIPT)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and "INTERPRETER-OK" in proc.stdout, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- Triton, CUDA

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPT_OSS = dict(hq=64, hkv=8, d=64, block_size=16, dtype=torch.bfloat16, device="cuda")


def _check_cuda(batch: Batch, window: int | None, sinks: Tensor | None, tol: float = 2e-2) -> None:
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, window, sinks)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, window, sinks)
    n = batch.num_real
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_decode_gpt_oss_shapes(window: int | None) -> None:
    sinks = torch.randn(64, device="cuda")
    for specs in ([(4096, 1)], [(1000, 1), (4000, 1), (17, 1), (2500, 1)]):
        _check_cuda(make_batch(specs, seed=21, **GPT_OSS), window, sinks)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_chunked_prefill_mixed_batch(window: int | None) -> None:
    specs = [(3000, 1000), (40, 1), (700, 700), (1030, 1), (513, 77)]
    _check_cuda(make_batch(specs, seed=22, pad_tokens=5, **GPT_OSS), window, torch.randn(64, device="cuda"))
    _check_cuda(make_batch([(4096, 4096)], seed=23, **GPT_OSS), window, None)


@pytest.mark.gpu
@gpu
def test_cuda_fp32_and_write_kv() -> None:
    batch = make_batch(MIXED, seed=24, pad_tokens=3, **dict(GPT_OSS, dtype=torch.float32))
    _check_cuda(batch, 8, torch.randn(64, device="cuda"), tol=1e-4)  # write_kv (Triton) filled the cache
    block_size = batch.k_cache.shape[1]
    for b, (seq_len, _) in enumerate(MIXED):
        pos = torch.arange(seq_len, device="cuda")
        blk = batch.meta.block_tables[b, pos // block_size].long()
        assert torch.equal(batch.k_cache[blk, pos % block_size], batch.keys[b].cuda())


@pytest.mark.gpu
@gpu
def test_cuda_graph_decode_replays_with_new_lengths() -> None:
    batch = make_batch([(3000, 1), (100, 1)], seed=25, **GPT_OSS)
    meta, sinks = batch.meta, torch.randn(64, device="cuda")
    meta.max_seq_len = 4096  # the runner captures for the longest context it allows
    run = lambda: paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, 0.125, 128, sinks)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    meta.seq_lens.copy_(torch.tensor([2000, 60], dtype=torch.int32))  # shorter contexts, same buffers
    graph.replay()
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, meta, 0.125, 128, sinks)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@gpu
def test_cuda_backend_env_selects_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch(MIXED, seed=26, **GPT_OSS)
    from triton_interp import use_kernels

    use_kernels(monkeypatch, "torch")
    out = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, 8, None)
    ref = paged_attention_reference(batch.q, batch.k_cache, batch.v_cache, batch.meta, 0.125, 8, None)
    assert torch.equal(out, ref)
