"""Prefill MoE in groups of experts (layers/batched_moe.py) against the per-expert reference."""

from __future__ import annotations

import pytest
import torch

from ferryman.layers.batched_moe import PREFILL_GROUP, fused_moe_batched, prefill_group
from ferryman.layers.moe_common import MoEActivation
from ferryman.layers.moe_reference import fused_moe_reference
from ferryman.quant import Banks, ExpertFormat, get_format


def _skewed_routing(t: int, k: int, e: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; expert 0 in every token and expert 1 in none, so groups pad
    runs of very different lengths and skip an expert. -> ids [T, K] int32, w [T, K] fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rest = torch.stack([torch.randperm(e - 2, generator=gen, device=device)[: k - 1] + 2 for _ in range(t)])
    ids = torch.cat((torch.zeros(t, 1, dtype=rest.dtype, device=device), rest), dim=1)
    w = torch.softmax(torch.randn(t, k, generator=gen, device=device), dim=-1)
    return ids.int(), w


def _mxfp4_case(t: int, seed: int) -> tuple[ExpertFormat, Banks, torch.Tensor, torch.Tensor, torch.Tensor,
                                             MoEActivation]:
    """(format, banks, x [t, 64], ids, w, activation): 10 MXFP4 experts with skewed routing."""
    form = get_format("mxfp4")
    gen = torch.Generator().manual_seed(seed)
    banks = form.random_banks(10, 64, 32, True, torch.float32, gen)
    x = torch.randn(t, 64, generator=gen)
    ids, w = _skewed_routing(t, 4, 10, seed + 1)
    return form, banks, x, ids, w, MoEActivation("swiglu_oai")


@pytest.mark.parametrize("fmt,act", [("dense", "silu"), ("mxfp4", "swiglu_oai")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 64])
def test_batched_equals_reference(fmt: str, act: str, dtype: torch.dtype, group: int) -> None:
    form = get_format(fmt)
    gen = torch.Generator().manual_seed(3)
    banks = form.random_banks(10, 64, 32, fmt == "mxfp4", dtype, gen)
    x = torch.randn(37, 64, generator=gen).to(dtype)
    ids, w = _skewed_routing(37, 4, 10, 4)
    a = MoEActivation(act)
    want = fused_moe_reference(form, banks, x, ids, w, a)
    got = fused_moe_batched(form, banks, x, ids, w, a, group=group)
    assert got.dtype == dtype and got.shape == want.shape
    # same terms, same per-token order; only bmm against mm may round differently
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("path", ["batched", "reference"])
def test_host_ids_group_without_a_device_read(path: str) -> None:
    """Given the ids on the host too, both prefill paths give the same tensor as without them."""
    form, banks, x, ids, w, a = _mxfp4_case(29, 8)
    fn = fused_moe_batched if path == "batched" else fused_moe_reference
    want = fn(form, banks, x, ids, w, a)
    assert torch.equal(fn(form, banks, x, ids, w, a, host_ids=ids.clone()), want)
    with pytest.raises(ValueError, match="host_ids"):
        fn(form, banks, x, ids, w, a, host_ids=ids[:3])


def test_inputs_issued_comes_once_before_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's large copies may start as soon as the pair layout is issued: the callback runs
    once, before the first group's kernels, and changes nothing in the result."""
    import ferryman.layers.batched_moe as bm

    form, banks, x, ids, w, a = _mxfp4_case(23, 5)
    want = fused_moe_batched(form, banks, x, ids, w, a, group=3)
    events: list[str] = []
    real = bm._group_forward

    def group_forward(*args, **kwargs) -> None:  # noqa: ANN002, ANN003 (a recording pass-through)
        events.append("group")
        real(*args, **kwargs)

    monkeypatch.setattr(bm, "_group_forward", group_forward)
    got = fused_moe_batched(form, banks, x, ids, w, a, group=3, inputs_issued=lambda: events.append("inputs"))
    assert torch.equal(got, want)
    flat = ids.flatten().tolist()
    counts = [flat.count(e) for e in sorted(set(flat))]  # expert 1 is never routed to: 9 of 10
    assert events == ["inputs"] + ["group"] * len(bm.expert_groups(counts, 3))


def test_fused_moe_calls_inputs_issued_once_on_every_path() -> None:
    from ferryman.layers.fused_moe import fused_moe

    form = get_format("dense")
    banks = form.random_banks(6, 32, 16, False, torch.float32, torch.Generator().manual_seed(1))
    x = torch.randn(5, 32)
    ids, w = _skewed_routing(5, 2, 6, 1)
    calls: list[int] = []
    got = fused_moe("dense", banks, x, ids, w, MoEActivation(), inputs_issued=lambda: calls.append(1))
    assert calls == [1]
    torch.testing.assert_close(got, fused_moe("dense", banks, x, ids, w, MoEActivation()))


def test_batched_rejects_a_bad_group() -> None:
    form = get_format("dense")
    banks = form.random_banks(4, 32, 16, False, torch.float32, torch.Generator().manual_seed(0))
    ids, w = _skewed_routing(3, 2, 4, 0)
    with pytest.raises(ValueError, match="group must be >= 1"):
        fused_moe_batched(form, banks, torch.zeros(3, 32), ids, w, MoEActivation(), group=0)


def _force_prefill_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from ferryman.layers import fused_moe as fm

    monkeypatch.setattr(fm, "prefill_path", lambda fmt, pairs=None, kernels=None: path)


def test_planner_counts_the_group_when_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    import ferryman.layers.batched_moe as bm
    from ferryman.models.registry import model_config
    from ferryman.planner import activation_bytes
    from ferryman.weights.presets import get_preset

    cfg = model_config(get_preset("gpt-oss-20b"))
    one_w13 = 2 * cfg.moe_intermediate_size * cfg.hidden_size * 2  # bf16 w13 of one expert
    _force_prefill_path(monkeypatch, "grouped")  # dequantises none
    base = activation_bytes(cfg, torch.bfloat16, 2048, 1)
    _force_prefill_path(monkeypatch, "batched")
    assert activation_bytes(cfg, torch.bfloat16, 2048, 1) - base == PREFILL_GROUP * one_w13  # 33 MiB experts
    monkeypatch.setattr(bm, "PREFILL_GROUP", 1)
    monkeypatch.setattr(bm, "PREFILL_GROUP_BYTES", 3 * one_w13)
    assert activation_bytes(cfg, torch.bfloat16, 2048, 1) - base == 3 * one_w13


@pytest.mark.parametrize("inter, hidden, want", [(2880, 2880, PREFILL_GROUP), (2048, 7168, PREFILL_GROUP),
                                                 (768, 2048, 42), (512, 2048, 64), (64, 256, 64)])
def test_prefill_group_holds_its_bytes(inter: int, hidden: int, want: int) -> None:
    """Small experts go many to a launch, within the byte budget; big ones keep the floor."""
    from ferryman.layers.batched_moe import PREFILL_GROUP_BYTES, prefill_group

    got = prefill_group(inter, hidden, 2)
    assert got == want
    assert got == PREFILL_GROUP or got * 2 * inter * hidden * 2 <= PREFILL_GROUP_BYTES


@pytest.mark.parametrize("preset, dequantised", [("gpt-oss-20b", 8), ("qwen3-30b-a3b", 0)])  # batched, grouped
def test_planner_counts_what_the_default_path_dequantises(preset: str, dequantised: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP4 experts take the batched path (a group of 8 dequantised at once: 256 MiB of gpt-oss's), bf16
    ones the grouped GEMM (none); with the torch kernels (PlanRequest.kernels) the grouped kernel cannot run and fused_moe
    falls back to the batched path, which the plan then counts."""
    from ferryman.models.registry import model_config
    from ferryman.layers.backend import triton_available
    from ferryman.planner import activation_bytes
    from ferryman.weights.presets import get_preset

    cfg = model_config(get_preset(preset))
    one_w13 = 2 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    batched = prefill_group(cfg.moe_intermediate_size, cfg.hidden_size, 2)  # 8 for gpt-oss, 42 for qwen3-30b
    if not triton_available():
        dequantised = batched  # no grouped kernel: the batched path
    with monkeypatch.context() as m:
        _force_prefill_path(m, "grouped")
        base = activation_bytes(cfg, torch.bfloat16, 2048, 1)
    assert activation_bytes(cfg, torch.bfloat16, 2048, 1) - base == dequantised * one_w13
    assert activation_bytes(cfg, torch.bfloat16, 2048, 1, kernels="torch") - base == batched * one_w13


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_batched_equals_reference_at_gpt_oss_shapes() -> None:
    from ferryman.layers.fused_moe import fused_moe

    form = get_format("mxfp4")
    gen = torch.Generator(device="cuda").manual_seed(5)
    banks = form.random_banks(32, 2880, 2880, True, torch.bfloat16, gen, "cuda")
    x = torch.randn(1024, 2880, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = _skewed_routing(1024, 4, 32, 6, "cuda")
    a = MoEActivation("swiglu_oai")
    want = fused_moe_reference(form, banks, x, ids, w, a)
    got = fused_moe("mxfp4", banks, x, ids, w, a)  # 4096 MXFP4 pairs, past 2048: the dispatcher takes the batched path
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_demo_model_offload_with_batched_prefill_equals_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferryman import LLM
    from tiny_models import greedy_ids

    _force_prefill_path(monkeypatch, "batched")
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64, enforce_eager=True)
    resident = LLM(**kw)
    ids = [resident.encode(p) for p in ("def quicksort(xs):", "import os\nimport sys\n\n\nclass ")]
    offload = LLM(moe_strategy="offload", expert_cache="10%", **kw)
    assert greedy_ids(offload, ids, 24) == greedy_ids(resident, ids, 24)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("skew", [False, True])
def test_padded_layout_matches_its_definition(group: int, skew: bool) -> None:
    """Group j holds the experts expert_groups names, every run padded to the group's longest; a
    padding row repeats its expert's first sorted row and is marked invalid. Checked row by row in
    Python. Even runs keep slot order; skewed ones (one expert in every token) are regrouped so
    padding stays within PAD_SLACK of the pairs."""
    from ferryman.layers.batched_moe import PAD_SLACK, expert_groups, padded_layout

    gen = torch.Generator().manual_seed(group)
    counts = torch.randint(100, 109, (11,), generator=gen).tolist()
    if skew:
        counts[4] = 2000
    slots = sorted(torch.randperm(40, generator=gen)[:11].tolist())
    lay = padded_layout(slots, counts, group)
    members = expert_groups(counts, group)
    assert sorted(e for g in members for e in g) == list(range(11)) and all(len(g) <= group for g in members)
    assert (members == [list(range(g0, min(g0 + group, 11))) for g0 in range(0, 11, group)]) == (not skew or group == 1)
    assert lay.slots.tolist() == [slots[e] for g in members for e in g]
    rows, valid, want_groups, r0 = [], [], [], 0
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    for g in members:
        m = max(counts[e] for e in g)
        want_groups.append((sum(len(h) for h in members[: members.index(g)]), len(g), m, r0))
        for e in g:
            rows += [firsts[e] + r if r < counts[e] else firsts[e] for r in range(m)]
            valid += [r < counts[e] for r in range(m)]
        r0 += len(g) * m
    assert lay.groups == want_groups
    assert lay.rows.tolist() == rows and lay.valid.tolist() == valid
    assert len(rows) <= (1 + PAD_SLACK) * sum(counts)


def test_skewed_routing_pads_little_and_equals_reference() -> None:
    """Half the tokens on one expert (qwen3's dummy weights routed like this and a slot-order
    layout tripled the rows): the batched path still equals the reference."""
    form = get_format("dense")
    gen = torch.Generator().manual_seed(5)
    banks = form.random_banks(24, 64, 32, False, torch.float32, gen)
    x = torch.randn(256, 64, generator=gen)
    ids = torch.stack([torch.randperm(23, generator=gen)[:4] + 1 for _ in range(256)]).int()
    ids[::2, 0] = 0  # expert 0 in every other token
    w = torch.softmax(torch.randn(256, 4, generator=gen), dim=-1)
    a = MoEActivation("silu")
    got = fused_moe_batched(form, banks, x, ids, w, a, group=8)
    torch.testing.assert_close(got, fused_moe_reference(form, banks, x, ids, w, a))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("skew", [False, True])
def test_cuda_batched_peak_stays_within_the_planners_moe_share(skew: bool) -> None:
    """A qwen3-30b-a3b layer (bf16, 128 experts, top-8) on a 4096-token chunk: what the batched
    path allocates beyond its inputs stays within the planner's MoE share of the chunk
    (planner.activation_bytes: per pair item (3 I + H) + 4 H, a group's w13 once), with even
    routing and with half the tokens on expert 0 (slot-order groups once padded skewed runs to 3x
    the pairs and ran out of memory here)."""

    form, (t, k, e, h, i) = get_format("dense"), (4096, 8, 128, 2048, 768)
    gen = torch.Generator(device="cuda").manual_seed(0)
    banks = form.random_banks(e, h, i, False, torch.bfloat16, gen, "cuda")  # 1.2 GiB
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=-1).indices.int()
    if skew:  # expert 0 in every other token, in place of a pick it does not already hold
        half = ids[::2]
        half[:, 0] = torch.where((half == 0).any(dim=1), half[:, 0], 0)
    w = torch.softmax(torch.randn(t, k, device="cuda", generator=gen), dim=-1)
    host_ids = ids.cpu()
    fused_moe_batched(form, banks, x, ids, w, MoEActivation("silu"), host_ids=host_ids)  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fused_moe_batched(form, banks, x, ids, w, MoEActivation("silu"), host_ids=host_ids)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    item = x.element_size()
    share = t * k * (item * (3 * i + h) + 4 * h) + prefill_group(i, h, item) * 2 * i * h * item
    assert out.shape == (t, h) and out.isfinite().all()
    assert extra <= share, f"batched MoE peak {extra / 2**20:.0f} MiB > the planner's {share / 2**20:.0f} MiB"


@pytest.mark.parametrize("dups", [False, True])
def test_summing_rows_rank_each_tokens_terms_by_slot(dups: bool) -> None:
    """Row t*K + r of the summed output holds token t's r-th term in ascending slot order, ties in k
    order (a hybrid step maps its CPU pairs onto one slot): checked pair by pair in Python."""
    from ferryman.layers.batched_moe import summing_rows
    from ferryman.layers.moe_common import group_on_host

    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(9, generator=gen)[:4] for _ in range(50)])  # [T, K]
    if dups:
        ids[::3, 2] = ids[::3, 0]
    _, order, _ = group_on_host(ids.reshape(-1).numpy(), 9)
    rows = summing_rows(order, 4)
    for pos, pair in enumerate(order.tolist()):
        t, k = divmod(pair, 4)
        key = [(int(ids[t, j]), j) for j in range(4)]
        assert rows[pos] == t * 4 + sorted(key).index(key[k])
