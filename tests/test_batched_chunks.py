"""A layer-major job's chunks through the batched path with shared dequantisation
(layers/batched_chunks.py): each chunk bit for bit the batched path on that chunk alone."""

from __future__ import annotations

import pytest
import torch

import ferryman.layers.batched_chunks as bc
import ferryman.layers.fused_moe as fm
from ferryman.layers.batched_moe import fused_moe_batched
from ferryman.layers.moe_common import MoEActivation
from ferryman.quant import Banks, ExpertFormat, get_format

E, H, I = 10, 64, 32  # noqa: E741 (the experts' intermediate size)


def _routing(t: int, k: int, seed: int, skew: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [t, k] int32 distinct per token (skew: expert 0 in every token, expert 1 in none; None:
    balanced, every expert the same number of pairs when k t is a multiple of E), w fp32."""
    gen = torch.Generator().manual_seed(seed)
    if skew is None:
        ids = (torch.arange(t)[:, None] * k + torch.arange(k)[None, :]) % E
    elif skew:
        rest = torch.stack([torch.randperm(E - 2, generator=gen)[: k - 1] + 2 for _ in range(t)])
        ids = torch.cat((torch.zeros(t, 1, dtype=rest.dtype), rest), dim=1)
    else:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
    return ids.int(), torch.softmax(torch.randn(t, k, generator=gen), dim=-1)


def _case(fmt: str, dtype: torch.dtype, sizes: list[int], skews: list[bool | None]) -> tuple[
        ExpertFormat, Banks, torch.Tensor, list[tuple[int, int]], list[torch.Tensor], list[torch.Tensor]]:
    form = get_format(fmt)
    gen = torch.Generator().manual_seed(7)
    banks = form.random_banks(E, H, I, fmt == "mxfp4", dtype, gen)
    x = torch.randn(sum(sizes), H, generator=gen).to(dtype)
    bounds, ids, ws, a = [], [], [], 0
    for c, (t, skew) in enumerate(zip(sizes, skews)):
        bounds.append((a, a + t))
        i, w = _routing(t, 4, 11 + c, skew)
        ids.append(i)
        ws.append(w)
        a += t
    return form, banks, x, bounds, ids, ws


def _run(form: ExpertFormat, banks: Banks, x: torch.Tensor, bounds: list[tuple[int, int]], ids: list[torch.Tensor],
         ws: list[torch.Tensor], act: MoEActivation, **kw: object) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}

    def emit(c: int, y: torch.Tensor) -> None:
        assert c not in out, f"chunk {c} emitted twice"
        out[c] = y.clone()

    bc.fused_moe_batched_chunks(form, banks, x, bounds, ids, ws, act, emit, **kw)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("fmt,act", [("dense", "silu"), ("mxfp4", "swiglu_oai")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 64])
def test_each_chunk_equals_the_batched_path_alone(fmt: str, act: str, dtype: torch.dtype, group: int) -> None:
    """Equal and unequal chunks, skewed and uniform routing (different group layouts per chunk),
    a chunk of 2 tokens: every output bit for bit fused_moe_batched on that chunk."""
    form, banks, x, bounds, ids, ws = _case(fmt, dtype, [37, 37, 20, 2], [False, False, True, False])
    a = MoEActivation(act)
    got = _run(form, banks, x, bounds, ids, ws, a, group=group, host_ids=[i.clone() for i in ids])
    assert sorted(got) == [0, 1, 2, 3]
    for c, (lo, hi) in enumerate(bounds):
        want = fused_moe_batched(form, banks, x[lo:hi], ids[c], ws[c], a, group=group)
        assert got[c].dtype == dtype and torch.equal(got[c], want), f"chunk {c}"


def _count_dequant(monkeypatch: pytest.MonkeyPatch, form: ExpertFormat) -> list[str]:
    calls: list[str] = []
    real = form.dequant

    def dequant(banks: Banks, part: str, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(part)
        return real(banks, part, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(form, "dequant", dequant)
    return calls


def test_chunks_of_one_layout_dequantise_each_group_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three chunks that use every expert evenly (groups of 3: the same 4 groups each): in one window,
    4 w13 and 4 w2 dequantisations for the job, not 12 each; with a budget of one chunk per window,
    12 each again, same outputs."""
    form, banks, x, bounds, ids, ws = _case("mxfp4", torch.float32, [40, 40, 40], [None] * 3)
    assert all(torch.unique(i).numel() == E for i in ids)
    a = MoEActivation("swiglu_oai")
    calls = _count_dequant(monkeypatch, form)
    monkeypatch.setattr(bc, "pair_bytes", lambda *args: 1 << 30)  # one window
    shared = _run(form, banks, x, bounds, ids, ws, a, group=3)
    assert calls.count("w13") == 4 and calls.count("w2") == 4
    calls.clear()
    monkeypatch.setattr(bc, "pair_bytes", lambda *args: 1)  # every window one chunk
    alone = _run(form, banks, x, bounds, ids, ws, a, group=3)
    assert calls.count("w13") == 12 and calls.count("w2") == 12
    assert all(torch.equal(shared[c], alone[c]) for c in range(3))


def test_windows_fit_the_budget() -> None:
    form, banks, x, bounds, ids, ws = _case("dense", torch.float32, [30, 30, 30, 30, 5], [False] * 5)
    from ferryman.layers.batched_moe import padded_layout
    from ferryman.layers.moe_common import group_by_slot, to_device

    laid = []
    for c, (lo, hi) in enumerate(bounds):
        slots, order, counts = group_by_slot(ids[c], E)
        laid.append(bc.ChunkLayout(c, lo, hi, ids[c], ws[c], order, padded_layout(slots, counts, 3, to_device(x.device))))
    one = bc.window_bytes(laid[:1], H, I, 4)
    two = bc.window_bytes(laid[:2], H, I, 4)
    assert one < two < 2 * one + 1  # the pair outputs add up, a group's activations are shared
    windows = bc.chunk_windows(laid, H, I, 4, two)
    assert [[c.index for c in w] for w in windows] == [[0, 1], [2, 3], [4]]
    assert all(bc.window_bytes(w, H, I, 4) <= two for w in windows)
    assert [[c.index for c in w] for w in bc.chunk_windows(laid, H, I, 4, 0)] == [[0], [1], [2], [3], [4]]


def test_fused_moe_chunks_mixes_paths_and_calls_inputs_issued_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of the batched path share dequantisation; the others (here on the CPU: the C kernel or
    the torch paths) run one by one as fused_moe; every chunk emitted once; inputs_issued once,
    before any output."""
    form, banks, x, bounds, ids, ws = _case("mxfp4", torch.float32, [33, 3, 33], [False, False, True])
    a = MoEActivation("swiglu_oai")
    monkeypatch.setattr(fm, "_batched", lambda fmt, x, i: i.shape[0] > 10)
    events: list[object] = []
    got: dict[int, torch.Tensor] = {}

    def emit(c: int, y: torch.Tensor) -> None:
        events.append(c)
        got[c] = y.clone()

    fm.fused_moe_chunks("mxfp4", banks, x, bounds, ids, ws, a, emit, inputs_issued=lambda: events.append("inputs"))
    assert events[0] == "inputs" and events.count("inputs") == 1 and sorted(got) == [0, 1, 2]
    for c, (lo, hi) in enumerate(bounds):
        if c == 1:
            want = fm.fused_moe("mxfp4", banks, x[lo:hi], ids[c], ws[c], a)
        else:
            want = fused_moe_batched(form, banks, x[lo:hi], ids[c], ws[c], a)
        assert torch.equal(got[c], want), f"chunk {c}"


def test_fused_moe_chunks_checks_each_chunk() -> None:
    form, banks, x, bounds, ids, ws = _case("dense", torch.float32, [5, 5], [False, False])
    with pytest.raises(ValueError, match="topk_ids must be"):
        fm.fused_moe_chunks("dense", banks, x, bounds, [ids[0], ids[1][:3]], ws, MoEActivation("silu"),
                            lambda c, y: None)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("tokens", [512, 4096])
def test_the_window_budget_is_within_the_planned_chunk(preset: str, tokens: int) -> None:
    """What a window may hold (chunk_moe_bytes) is part of what the planner counts per token of a
    chunk (activation_bytes between two chunks that take the same prefill path)."""
    from ferryman.models.registry import model_config
    from ferryman.planner import activation_bytes
    from ferryman.weights.presets import get_preset

    cfg = model_config(get_preset(preset))
    per_chunk = activation_bytes(cfg, torch.bfloat16, 1024 + tokens, 1) - activation_bytes(cfg, torch.bfloat16, 1024, 1)
    moe = bc.chunk_moe_bytes(tokens, cfg.top_k, cfg.hidden_size, cfg.moe_intermediate_size, 2)
    assert 0 < moe <= per_chunk


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,act", [("mxfp4", "swiglu_oai"), ("dense", "silu")])
def test_gpu_chunks_equal_the_batched_path_alone(fmt: str, act: str) -> None:
    """On CUDA (the Triton dequantisers, bias and activation kernel, cuBLAS bmm): four 1024-token
    chunks of 32 experts and a 40-token one, bf16: each output bit for bit fused_moe on that chunk
    (the batched path for the four, the decode kernel for the last); with groups of 8, bit for bit
    fused_moe_batched with groups of 8."""
    form = get_format(fmt)
    gen = torch.Generator().manual_seed(5)
    banks = {k: v.cuda() for k, v in form.random_banks(32, 512, 256, fmt == "mxfp4", torch.bfloat16, gen).items()}
    sizes = [1024, 1024, 1024, 1024, 40]
    x = torch.randn(sum(sizes), 512, generator=gen).to(torch.bfloat16).cuda()
    bounds, ids, ws, lo = [], [], [], 0
    for t in sizes:
        bounds.append((lo, lo + t))
        ids.append(torch.stack([torch.randperm(32, generator=gen)[:4] for _ in range(t)]).int().cuda())
        ws.append(torch.softmax(torch.randn(t, 4, generator=gen), -1).cuda())
        lo += t
    a = MoEActivation(act)
    assert all(fm._batched(fmt, x, i) for i in ids[:4])
    want = [fm.fused_moe(fmt, banks, x[lo:hi], ids[c], ws[c], a) for c, (lo, hi) in enumerate(bounds)]
    got: dict[int, torch.Tensor] = {}
    fm.fused_moe_chunks(fmt, banks, x, bounds, ids, ws, a, lambda c, y: got.__setitem__(c, y.clone()),
                        host_ids=[i.cpu() for i in ids])
    assert all(torch.equal(got[c], want[c]) for c in range(5))
    alone = _run(form, banks, x, bounds[:4], ids[:4], ws[:4], a, group=8)
    assert all(torch.equal(alone[c], fused_moe_batched(form, banks, x[lo:hi], ids[c], ws[c], a, group=8))
               for c, (lo, hi) in enumerate(bounds[:4]))
