"""Multi-head latent attention (layers/mla.py): the absorbed form over the paged latent cache equals
the expanded form (per-head K/V from kv_b_proj, dense causal attention), and one layer equals
transformers' DeepseekV3Attention (q_lora_rank set and null, interleaved rope, yarn mscale) over
chunked prefill and decode steps."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.mla import MLAttention
from ferryman.layers.rotary import RotaryEmbedding
from ferryman.models.registry import model_config

BLOCK = 4
TINY = dict(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=32, n_group=1, topk_group=1,
            first_k_dense_replace=1, max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                                 mscale=0.9, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0))


def hf_config(q_lora_rank: int | None, interleave: bool = True):  # noqa: ANN201
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v3", **TINY, q_lora_rank=q_lora_rank, rope_interleave=interleave)
    cfg._attn_implementation = "eager"
    return cfg


def build_layer(hf_cfg, num_blocks: int, seed: int = 0) -> MLAttention:  # noqa: ANN001
    torch.manual_seed(seed)
    cfg = model_config(hf_cfg.to_dict())
    layer = MLAttention(cfg, 0, RotaryEmbedding(cfg.rope, cfg.head_dim, 256))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
    layer.k_cache = torch.zeros(layer.cache_shape(num_blocks, BLOCK))
    return layer


def step_meta(tables: list[list[int]], starts: list[int], ends: list[int]) -> AttnMetadata:
    """One step: sequence b computes positions [starts[b], ends[b]) with block table tables[b]."""
    lens = [e - s for s, e in zip(starts, ends)]
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for b in range(len(tables)) for p in range(starts[b], ends[b])]
    width = max(len(t) for t in tables)
    return AttnMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(ends, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(lens), max_seq_len=max(ends),
    )


def expanded(layer: MLAttention, positions: Tensor, x: Tensor) -> Tensor:
    """The same layer over a whole sequence x: [L, hidden], per-head K and V built from the latents."""
    m, H = layer.mla, layer.num_heads
    q_nope, q_rope = layer.queries(x)
    entry, q_rope = layer.cache_entry(positions, x, q_rope)
    latent, k_rope = entry[:, : m.kv_lora_rank], entry[:, m.kv_lora_rank :]
    kv = layer.kv_b_proj(latent).view(-1, H, m.qk_nope_head_dim + m.v_head_dim)
    k = torch.cat((kv[..., : m.qk_nope_head_dim], k_rope[:, None, :].expand(-1, H, -1)), dim=-1)  # [L, H, Dq]
    v = kv[..., m.qk_nope_head_dim :]  # [L, H, Dv]
    q = torch.cat((q_nope, q_rope), dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * m.softmax_scale
    L = x.shape[0]
    scores.masked_fill_(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return layer.o_proj(o.reshape(L, H * m.v_head_dim))


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_absorbed_equals_expanded(q_lora_rank: int | None) -> None:
    """Two sequences, each prefilled in two chunks then decoded, sharing steps; blocks shuffled."""
    layer = build_layer(hf_config(q_lora_rank), num_blocks=24)
    lengths, prefill = [23, 17], [(0, 9, 19), (0, 6, 14)]  # chunk bounds, then one token per step
    xs = [torch.randn(n, 48) for n in lengths]
    perm = torch.randperm(24).tolist()
    tables = [perm[:6], perm[6:11]]
    got: list[list[Tensor]] = [[], []]
    bounds = [list(zip(p[:-1], p[1:])) + [(i, i + 1) for i in range(p[-1], n)] for p, n in zip(prefill, lengths)]
    for step in range(max(len(b) for b in bounds)):
        live = [b for b in range(2) if step < len(bounds[b])]
        starts, ends = [bounds[b][step][0] for b in live], [bounds[b][step][1] for b in live]
        x = torch.cat([xs[b][s:e] for b, s, e in zip(live, starts, ends)])
        pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
        out = layer(pos, x, step_meta([tables[b] for b in live], starts, ends))
        for b, piece in zip(live, out.split([e - s for s, e in zip(starts, ends)])):
            got[b].append(piece)
    for b in range(2):
        want = expanded(layer, torch.arange(lengths[b]), xs[b])
        torch.testing.assert_close(torch.cat(got[b]), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank,interleave", [(16, True), (None, True), (16, False)])
def test_layer_matches_transformers(q_lora_rank: int | None, interleave: bool) -> None:
    """One sequence of 21 tokens: a 13-token prefill in two chunks, then 8 decode steps."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    hf_cfg = hf_config(q_lora_rank, interleave)
    layer = build_layer(hf_cfg, num_blocks=8, seed=1)
    ref = hf.DeepseekV3Attention(hf_cfg, 0).eval()
    missing, unexpected = ref.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if not k.startswith("rotary.")}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    L = 21
    x = torch.randn(L, 48)
    pos = torch.arange(L)
    with torch.no_grad():
        cos, sin = hf.DeepseekV3RotaryEmbedding(hf_cfg)(x[None], pos[None])
        mask = torch.zeros(L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        want = ref(x[None], (cos, sin), mask[None, None])[0][0]
        table = [5, 2, 7, 0, 3, 6]
        bounds = [(0, 6), (6, 13)] + [(i, i + 1) for i in range(13, L)]
        got = torch.cat([layer(pos[s:e], x[s:e], step_meta([table], [s], [e])) for s, e in bounds])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_prefill_pieces_equal_the_absorbed_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expanded prefill (mla_prefill.py) over head groups of 3 (4 heads: a partial group) and
    query chunks of a few rows equals the absorbed form over the same cache, a cached prefix included."""
    from ferryman.layers import mla_prefill
    from ferryman.layers.mla_attention import latent_attention_reference, write_latent

    layer = build_layer(hf_config(16), num_blocks=12)
    m = layer.mla
    x = torch.randn(30, 48)
    with torch.no_grad():
        layer(torch.arange(11), x[:11], step_meta([[3, 0, 7, 9, 1, 4, 2, 8]], [0], [11]))  # the cached prefix
        meta = step_meta([[3, 0, 7, 9, 1, 4, 2, 8]], [11], [30])
        q_nope, q_rope = layer.queries(x[11:])
        entry, q_rope = layer.cache_entry(torch.arange(11, 30), x[11:], q_rope)
        write_latent(entry, layer.k_cache, meta.slot_mapping)
        w_uk, w_uv = layer.up_weights()
        q = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope), dim=-1)
        o = latent_attention_reference(q, layer.k_cache, meta, m.softmax_scale, m.kv_lora_rank)  # [T, H, Dl]
        want = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
        monkeypatch.setattr(mla_prefill, "HEAD_GROUP", 3)
        monkeypatch.setattr(mla_prefill, "MAX_SCORE_ELEMS", 3 * 30 * 4)  # 4 query rows per chunk
        got = mla_prefill.expanded_prefill(q_nope, q_rope, layer.k_cache, meta, w_uk, w_uv, m.softmax_scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_latent_cache_holds_latent_and_rope_only() -> None:
    """The cache is [N, S, 1, kv_lora_rank + qk_rope_head_dim] and holds each token's entry."""
    layer = build_layer(hf_config(16), num_blocks=4)
    assert tuple(layer.k_cache.shape) == (4, BLOCK, 1, 24 + 8) and layer.v_cache is None
    x = torch.randn(5, 48)
    with torch.no_grad():
        layer(torch.arange(5), x, step_meta([[2, 1]], [0], [5]))
        entry, _ = layer.cache_entry(torch.arange(5), x, layer.queries(x)[1])
    torch.testing.assert_close(layer.k_cache[2, :, 0], entry[:4])
    torch.testing.assert_close(layer.k_cache[1, 0, 0], entry[4])


KERNEL_CHECK = """
import torch
from ferryman.layers.attn_metadata import AttnMetadata
from ferryman.layers.mla_attention import latent_attention_reference
from ferryman.layers.mla_triton import latent_decode_triton

torch.manual_seed(0)
lens, S, C, Dl, H = [1, 5, 40, 97], 4, 40, 32, 20
tables = torch.randperm(128)[:4 * 25].view(4, 25).int()
cache = torch.randn(128, S, 1, C)
q = torch.randn(len(lens), H, C)
meta = AttnMetadata(query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                    seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                    slot_mapping=torch.zeros(len(lens), dtype=torch.int64), max_query_len=1, max_seq_len=max(lens))
want = latent_attention_reference(q, cache, meta, 0.3, Dl)
for splits in (1, 2, 4):
    got = latent_decode_triton(q, cache, meta, 0.3, Dl, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
print("ok")
"""


def test_triton_latent_decode_matches_reference_interpreted() -> None:
    """The Triton decode kernel (head blocks of 16 over 20 heads, kv splits, a 1-token sequence)
    equals the torch path, under TRITON_INTERPRET=1."""
    from triton_interp import run_interpreted

    assert run_interpreted(KERNEL_CHECK).strip().endswith("ok")


@pytest.mark.gpu
def test_triton_latent_decode_matches_reference_cuda() -> None:
    """DeepSeek-V3's shapes (128 heads, latent 512 + rope 64) on CUDA in bf16, splits chosen."""
    from ferryman.layers.mla_attention import latent_attention_reference, write_latent
    from ferryman.layers.mla_triton import latent_decode_triton

    torch.manual_seed(0)
    lens, S, Dl, H = [1, 100, 1000, 4000], 16, 512, 128
    tables = torch.randperm(1024)[: 4 * 250].view(4, 250).int().cuda()
    cache = torch.randn(1024, S, 1, Dl + 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(len(lens), H, Dl + 64, device="cuda", dtype=torch.bfloat16)
    meta = AttnMetadata(query_start_loc=torch.arange(5, dtype=torch.int32, device="cuda"),
                        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_tables=tables,
                        slot_mapping=torch.zeros(4, dtype=torch.int64, device="cuda"), max_query_len=1,
                        max_seq_len=max(lens))
    want = latent_attention_reference(q, cache, meta, 0.05, Dl).float()
    torch.testing.assert_close(latent_decode_triton(q, cache, meta, 0.05, Dl).float(), want, rtol=2e-2, atol=2e-2)
