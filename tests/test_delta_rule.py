"""The gated delta rule: the chunked form against the token-by-token recurrence (CPU, fp32), a prompt
cut into chunks against the whole, and flash-linear-attention's kernels against the torch path (GPU),
whole and in the segment rounds that save states inside a chunk (delta_rule_cut)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from ferryman.layers import delta_rule
from ferryman.layers.delta_rule import (chunk_delta_rule, delta_rule_cut, delta_rule_fla, delta_rule_torch, fla_kernels,
                                        fla_prefill, step_delta_rule)


def _inputs(T: int, Hk: int = 2, Hv: int = 4, D: int = 16, seed: int = 0, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, Hk, D, generator=g) for _ in range(2))
    v = torch.randn(T, Hv, D, generator=g)
    decay = -torch.rand(T, Hv, generator=g) * 0.3  # log decays in (-0.3, 0]
    beta = torch.rand(T, Hv, generator=g)
    return tuple(t.to(device, dtype if t.dim() == 3 else torch.float32) for t in (q, k, v, decay, beta))


def test_chunked_form_equals_the_recurrence() -> None:
    q, k, v, g, beta = _inputs(150)  # 3 chunks of 64, the last one padded
    init = torch.randn(1, 4, 16, 16) * 0.1
    out, final = delta_rule_torch(q, k, v, g, beta, [0, 150], init)
    qn, kn = delta_rule.prepare_qk(q, k, 2)
    state, steps = init.clone(), []
    for t in range(150):
        o, state = step_delta_rule(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state, rtol=1e-4, atol=1e-4)


def test_a_prompt_in_pieces_equals_the_whole() -> None:
    """Chunked prefill: each piece starts from the state the last one ended with."""
    q, k, v, g, beta = _inputs(100, seed=1)
    zero = torch.zeros(1, 4, 16, 16)
    whole, final = delta_rule_torch(q, k, v, g, beta, [0, 100], zero)
    first, mid = delta_rule_torch(q[:37], k[:37], v[:37], g[:37], beta[:37], [0, 37], zero)
    second, end = delta_rule_torch(q[37:], k[37:], v[37:], g[37:], beta[37:], [0, 63], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end, final, rtol=1e-4, atol=1e-4)


def test_chunk_size_does_not_change_the_result() -> None:
    q, k, v, g, beta = (t.transpose(0, 1) for t in _inputs(90, Hk=4, seed=2))
    q, k = delta_rule.l2norm(q) * 16 ** -0.5, delta_rule.l2norm(k)
    state = torch.zeros(4, 16, 16)
    a, sa = chunk_delta_rule(q, k, v, g, beta, state, chunk=64)
    b, sb = chunk_delta_rule(q, k, v, g, beta, state, chunk=16)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="flash-linear-attention is installed")
def test_missing_fla_warns_once(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_rule, "_fla", {})
    with caplog.at_level(logging.WARNING, logger="ferryman.layers"):
        assert fla_kernels() is None and fla_kernels() is None
    assert sum("flash-linear-attention is not installed" in r.message for r in caplog.records) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("lengths", [[5, 70, 130], [1, 1, 1, 1], [5, 300]])
def test_fla_equals_the_torch_path(lengths: list[int], host: bool) -> None:
    """Packed sequences with their own initial states (prefill chunks, then a decode step); with the
    host starts, short prefills take the recurrent kernel."""
    kernels = fla_kernels()
    if kernels is None:
        pytest.skip("flash-linear-attention is not installed")
    T, starts = sum(lengths), [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    q, k, v, g, beta = _inputs(T, Hk=2, Hv=4, D=64, seed=3, device="cuda", dtype=torch.bfloat16)
    init = torch.randn(len(lengths), 4, 64, 64, device="cuda") * 0.1
    want, want_final = delta_rule_torch(q, k, v, g, beta, starts, init)
    decode = max(lengths) == 1
    got, final = delta_rule_fla(q, k, v, g, beta.bfloat16(), torch.tensor(starts, device="cuda"), init.clone(),
                                decode, kernels, starts if host else None)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(final.float(), want_final, rtol=3e-2, atol=3e-2)


# fla 0.6.0's signatures (fla/ops/gated_delta_rule/chunk.py, fused_recurrent.py): the recurrent
# kernel takes gk, gv after g, so the two positional orders differ after g
def _fla_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,  # noqa: ANN001, ANN202
               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
               state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None,
               **kwargs):
    assert cu_seqlens_cpu is None or (cu_seqlens_cpu.device.type == "cpu"
                                      and cu_seqlens_cpu.tolist() == cu_seqlens.tolist())
    return _fla_reference(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _fla_recurrent(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,  # noqa: ANN001, ANN202
                   output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                   dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                   cu_seqlens=None, **kwargs):
    assert gk is None and gv is None, "per-key / per-value decays given: an argument landed in gk or gv"
    return _fla_reference(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _fla_reference(q, k, v, g, beta, scale, init, l2norm, cu_seqlens):  # noqa: ANN001, ANN202
    """What fla computes, on the torch path: [1, T, ...] varlen inputs, defaults as fla's."""
    assert l2norm and q.shape[0] == 1 and cu_seqlens is not None and init is not None
    beta = torch.ones_like(q[..., 0]) if beta is None else beta
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, final = delta_rule_torch(q[0], k[0], v[0], g[0].float(), beta[0].float(), cu_seqlens.tolist(), init)
    return (o * (scale / q.shape[-1] ** -0.5)).unsqueeze(0), final


@pytest.mark.parametrize("lengths", [[5, 70, 130], [1, 1, 1, 1]])
def test_fla_kernels_get_each_argument_where_their_signature_wants_it(lengths: list[int]) -> None:
    """delta_rule_fla against stand-ins with fla's exact signatures that compute the torch path: a
    beta handed to the recurrent kernel by position would land in its gk."""
    T, starts = sum(lengths), [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    q, k, v, g, beta = _inputs(T, seed=4)
    init = torch.randn(len(lengths), 4, 16, 16) * 0.1
    want, want_final = delta_rule_torch(q, k, v, g, beta, starts, init)
    kernels = {"chunk": _fla_chunk, "recurrent": _fla_recurrent}
    for host in (None, starts):  # the host starts, when given, reach the chunk kernel as cu_seqlens_cpu
        got, final = delta_rule_fla(q, k, v, g, beta, torch.tensor(starts), init.clone(), max(lengths) == 1,
                                    kernels, host)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(final, want_final)


@pytest.mark.parametrize(("lengths", "want"), [([5, 70, 130], "recurrent"), ([5, 300], "chunk"), ([1, 1], "recurrent")])
def test_short_prefills_take_the_recurrent_kernel(lengths: list[int], want: str) -> None:
    """With the host starts, a prefill whose longest sequence fits FLA_RECURRENT_MAX_TOKENS is one
    recurrent launch; a longer one the chunk kernel."""
    assert 130 <= delta_rule.FLA_RECURRENT_MAX_TOKENS < 300  # the cases straddle it
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    q, k, v, g, beta = _inputs(starts[-1], seed=7)
    init = torch.randn(len(lengths), 4, 16, 16) * 0.1
    called: list[str] = []
    kernels = {name: (lambda f, name: lambda **kw: called.append(name) or f(**kw))(f, name)
               for name, f in (("chunk", _fla_chunk), ("recurrent", _fla_recurrent))}
    got, _ = delta_rule_fla(q, k, v, g, beta, torch.tensor(starts), init, False, kernels, starts)
    assert called == [want]
    torch.testing.assert_close(got, delta_rule_torch(q, k, v, g, beta, starts, init)[0])


def test_fla_runs_only_for_half_precision_on_cuda() -> None:
    """fp32 models take the exact torch path on every device (fla's chunk kernels multiply in TF32)."""
    assert delta_rule.fla_kernels_for(torch.zeros(1, dtype=torch.bfloat16)) is None  # CPU
    assert delta_rule.fla_kernels_for(torch.zeros(1, dtype=torch.float32, device="meta")) is None


CUT_LENGTHS, CUTS = [70, 5, 130], [[64], [], [1, 129]]  # no, one and two cuts (one right after the start)


def _cut_inputs(device: str, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], list[int], torch.Tensor]:
    starts = [sum(CUT_LENGTHS[:i]) for i in range(len(CUT_LENGTHS) + 1)]
    D = 64 if device == "cuda" else 16
    init = torch.randn(len(CUT_LENGTHS), 4, D, D, generator=torch.Generator().manual_seed(5)).to(device) * 0.1
    return _inputs(starts[-1], D=D, seed=6, device=device, dtype=dtype), starts, init


def test_segment_rounds_pass_fla_its_arguments() -> None:
    """fla_prefill in delta_rule_cut against the torch path, on stand-ins with fla's signatures."""
    (q, k, v, g, beta), starts, init = _cut_inputs("cpu", torch.float32)
    want = delta_rule_cut(q, k, v, g, beta, starts, CUTS, init, delta_rule_torch)
    kernel = fla_prefill({"chunk": _fla_chunk, "recurrent": _fla_recurrent})
    got = delta_rule_cut(q, k, v, g, beta, starts, CUTS, init.clone(), kernel)
    torch.testing.assert_close(got[:2], want[:2])
    torch.testing.assert_close(got[2], want[2])


@pytest.mark.gpu
def test_fla_segment_rounds_equal_the_torch_path() -> None:
    """The fla kernels in segment rounds (bf16): outputs, final states and the states at the cuts."""
    kernels = fla_kernels()
    if kernels is None:
        pytest.skip("flash-linear-attention is not installed")
    (q, k, v, g, beta), starts, init = _cut_inputs("cuda", torch.bfloat16)
    o, final, mids = delta_rule_cut(q, k, v, g, beta, starts, CUTS, init, delta_rule_torch)
    got_o, got_final, got_mids = delta_rule_cut(q, k, v, g, beta.bfloat16(), starts, CUTS, init.clone(),
                                                fla_prefill(kernels))
    torch.testing.assert_close(got_o.float(), o, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got_final.float(), final, rtol=3e-2, atol=3e-2)
    for got_states, states in zip(got_mids, mids, strict=True):
        for got_state, state in zip(got_states, states, strict=True):
            torch.testing.assert_close(got_state.float(), state, rtol=3e-2, atol=3e-2)
