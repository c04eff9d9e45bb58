"""The gated delta rule of Gated DeltaNet layers, over packed sequences with per-sequence state.

Per value head, with S the [Dk, Dv] state and per token t (q, k L2-normalised, q scaled by Dk^-0.5):
    S = exp(g_t) * S;  S = S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
The torch path is exact in fp32 (the chunked form for prefill chunks, the step form for decodes,
the same math as transformers' reference); on CUDA, for bf16/fp16 models, the flash-linear-attention
kernels run when the package is installed (the `gpu` extra), else the torch path with one warning.
fp32 models take the torch path on every device: fla's chunk kernels multiply fp32 in TF32 (~1e-3
relative), which an fp32 model (the reference dtype of the parity tests) must not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("ferryman.layers")
CHUNK = 64  # tokens per chunk of the chunked form
_fla: dict[str, Any] = {}  # the flash-linear-attention kernels once imported; {"missing": True} if absent


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_kernels() -> dict[str, Callable] | None:
    """flash-linear-attention's (chunk, recurrent) kernels, imported on first use; None when missing."""
    if not _fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except ImportError:
            log.warning("flash-linear-attention is not installed (pip install 'ferryman[gpu]'): gated DeltaNet "
                        "layers run the torch path on the GPU, which is much slower")
            _fla["missing"] = True
        else:
            _fla.update(chunk=chunk_gated_delta_rule, recurrent=fused_recurrent_gated_delta_rule)
    return None if "missing" in _fla else _fla


def fla_kernels_for(q: torch.Tensor) -> dict[str, Callable] | None:
    """The fla kernels if they should run on `q`'s device and dtype (CUDA, bf16/fp16), else None."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return None
    return fla_kernels()


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, all heads at once, fp32. q, k: [H, L, Dk] (normalised, q scaled); v: [H, L, Dv];
    g (log decay), beta: [H, L]; state: [H, Dk, Dv] -> (o [H, L, Dv], final state [H, Dk, Dv])."""
    H, L, Dv = v.shape
    pad = (-L) % chunk  # padded tokens have k = 0, beta = 0, g = 0: they change nothing
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [H, n, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    # the WY form: (I + strictly-lower(beta k k^T decay)) [u | w] = [beta v | beta k exp(cum)]
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_in, k_out = q * cum.exp()[..., None], k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state  # [H, C, Dv]
        out[:, i] = q_in[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_out[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, n * chunk, Dv)[:, :L], state


def step_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences, fp32. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H];
    state: [B, H, Dk, Dv] -> (o [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)  # [B, H, Dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def prepare_qk(q: torch.Tensor, k: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, key heads repeated to the value heads, L2-normalised, q scaled."""
    q, k = (l2norm(t.float().repeat_interleave(ratio, dim=-2)) for t in (q, k))
    return q * q.shape[-1] ** -0.5, k


def delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     starts: list[int], init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences. q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv] fp32; starts: [B+1]
    token offsets (host); init: [B, Hv, Dk, Dv] fp32 -> (o [T, Hv, Dv] fp32, final states [B, ...])."""
    q, k = prepare_qk(q, k, v.shape[1] // q.shape[1])
    v = v.float()
    B = len(starts) - 1
    if starts[-1] == B:  # one token each: a batched step
        return step_delta_rule(q, k, v, g, beta, init)
    out, finals = torch.empty_like(v), []
    for b in range(B):
        s, e = starts[b], starts[b + 1]
        o, st = chunk_delta_rule(*(t[s:e].transpose(0, 1) for t in (q, k, v, g, beta)), init[b])
        out[s:e] = o.transpose(0, 1)
        finals.append(st)
    return out, torch.stack(finals)


# Prefill segments up to this many tokens (the longest in the call) take fla's recurrent kernel: one
# launch, where the chunk kernel's pipeline of launches costs milliseconds of host time per layer (an
# agent's short turn is host-bound). benchmarks/bench_delta_rule.py on the H200 (2026-12-01, qwen3-next
# shapes, one sequence): chunk 1.27-1.32 ms of host time at any length; recurrent 0.15 ms of host,
# 0.43 ms synchronised at 256 tokens, 0.71 at 512, 1.29 at 1024 (chunk: 1.29-1.31), 4.03 at 2048.
FLA_RECURRENT_MAX_TOKENS = 256


def delta_rule_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   starts: torch.Tensor, init: torch.Tensor, decode: bool, kernels: dict[str, Callable],
                   host_starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """delta_rule_torch's contract on flash-linear-attention's kernels (starts: [B+1] int on the device;
    host_starts: the same on the host). Decode and short prefills (host_starts given, no sequence
    longer than FLA_RECURRENT_MAX_TOKENS) take the recurrent kernel; longer prefills the chunk kernel,
    given the host starts as `cu_seqlens_cpu` so that it builds its chunk indices without reading the
    device's starts back."""
    recurrent = decode or (host_starts is not None and
                           max(e - s for s, e in zip(host_starts, host_starts[1:])) <= FLA_RECURRENT_MAX_TOKENS)
    extra = {} if recurrent or host_starts is None else {"cu_seqlens_cpu": torch.tensor(host_starts, dtype=torch.int64)}
    kernel = kernels["recurrent" if recurrent else "chunk"]
    # every argument by name: the two kernels' positional orders differ (the recurrent one takes
    # gk, gv after g, so a positional beta would land in gk and beta default to ones)
    o, final = kernel(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0),
                      beta=beta.unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=init,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=starts.long(), **extra)
    return o.squeeze(0), final


# (q, k, v, g, beta, host starts [B+1], init [B, ...]) -> (o [T, Hv, Dv], final states [B, ...])
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], torch.Tensor],
                  tuple[torch.Tensor, torch.Tensor]]


def fla_prefill(kernels: dict[str, Callable]) -> Kernel:
    """fla's kernels as a prefill `Kernel`: delta_rule_fla with the starts on both sides."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            starts: list[int], init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device_starts = torch.tensor(starts, dtype=torch.int64).to(q.device, non_blocking=True)
        return delta_rule_fla(q, k, v, g, beta, device_starts, init, False, kernels, starts)
    return run


def delta_rule_cut(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   starts: list[int], cuts: list[list[int]], init: torch.Tensor,
                   kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """`kernel`'s contract, plus the state of sequence b after the first c tokens of its part for each
    c in cuts[b] (ascending, 0 < c < its length) -> (o, final states, [B] lists of [Hv, Dk, Dv]).

    The sequences run in rounds: round r packs every sequence's r-th segment (between its cuts) and
    starts each from the state its segment r - 1 ended with, so a state at a cut is a round's final
    state; a sequence without cuts runs whole in round 0. Rounds: 1 + the most cuts of a sequence."""
    B = len(starts) - 1
    bounds = [[starts[b], *(starts[b] + c for c in cuts[b]), starts[b + 1]] for b in range(B)]
    states, mids = list(init.unbind(0)), [[] for _ in range(B)]  # states: [B] of [Hv, Dk, Dv]
    out: torch.Tensor | None = None
    for r in range(max(len(b) for b in bounds) - 1):
        members = [b for b in range(B) if len(bounds[b]) - 1 > r]
        rows = [i for b in members for i in range(bounds[b][r], bounds[b][r + 1])]
        idx = torch.tensor(rows, dtype=torch.int64).to(q.device, non_blocking=True)  # [T_r]
        lens = [bounds[b][r + 1] - bounds[b][r] for b in members]
        round_starts = [sum(lens[:j]) for j in range(len(lens) + 1)]
        o, finals = kernel(q[idx], k[idx], v[idx], g[idx], beta[idx], round_starts,
                           torch.stack([states[b] for b in members]))
        out = o.new_empty((q.shape[0], *o.shape[1:])) if out is None else out
        out[idx] = o
        for j, b in enumerate(members):
            states[b] = finals[j].to(init.dtype)
            if r < len(bounds[b]) - 2:  # this segment ends at a cut
                mids[b].append(states[b])
    assert out is not None  # at least one round
    return out, torch.stack(states), mids
