"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5.

x -> projections (q, k, v; the output gate z; beta's and the decay's inputs b, a) -> causal depthwise
convolution over q|k|v + SiLU -> gated delta rule (layers/delta_rule.py) -> RMSNorm gated by silu(z)
-> out_proj. Each sequence carries two states between steps, in the state pool's slot the scheduler
gave it (kvcache/state_pool.py): the convolution's last K-1 inputs and the [Hv, Dk, Dv] recurrent state.
The runner binds `conv_state` [N, C, K-1] (model dtype) and `ssm_state` [N, Hv, Dk, Dv] (fp32), and
with prefix caching the checkpoint store's `checkpoint_conv` [M, C, K-1] and `checkpoint_ssm`
[M, Hv, Dk, Dv] (kvcache/state_checkpoints.py): a step's saves inside a chunk (StateMetadata.host_saves)
are written there during the forward, so a prefill chunk runs past checkpoint positions in one step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferryman.config import LinearAttnConfig, ModelConfig
from ferryman.layers.attn_metadata import AttnMetadata, StateMetadata
from ferryman.layers.delta_rule import delta_rule_cut, delta_rule_fla, delta_rule_torch, fla_kernels_for, fla_prefill
from ferryman.layers.norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        la = cfg.linear_attn
        if la is None:
            raise ValueError(f"layer {layer} is a linear-attention layer but the config has no linear_attn")
        self.la, self.layer = la, layer
        H, Hv = cfg.hidden_size, la.num_v_heads
        if la.fused_projections:  # Qwen3-Next: grouped per key head
            self.in_proj_qkvz = nn.Linear(H, la.conv_dim + la.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(H, 2 * Hv, bias=False)
        else:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(H, la.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(H, la.value_dim, bias=False)
            self.in_proj_b = nn.Linear(H, Hv, bias=False)
            self.in_proj_a = nn.Linear(H, Hv, bias=False)
        # only its weight [C, 1, K] is used (a depthwise kernel per channel)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNorm(la.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(la.value_dim, H, bias=False)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.checkpoint_conv: torch.Tensor | None = None
        self.checkpoint_ssm: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        st = meta.state
        if st is None or self.conv_state is None or self.ssm_state is None:
            raise RuntimeError(f"linear-attention layer {self.layer} ran without its state pool or state slots")
        la, T = self.la, x.shape[0]
        mixed, z, b, a = self.project(x)
        mixed = self.convolve(mixed, st)  # [T, C]
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.reshape(T, la.num_k_heads, la.k_head_dim)
        k = k.reshape(T, la.num_k_heads, la.k_head_dim)
        v = v.reshape(T, la.num_v_heads, la.v_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] log decay
        o = self.recur(q, k, v, g, beta, st, meta.query_start_loc, decode=meta.max_query_len == 1)  # [T, Hv, Dv]
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(T, la.value_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        la, T = self.la, x.shape[0]
        if not la.fused_projections:
            z = self.in_proj_z(x).reshape(T, la.num_v_heads, la.v_head_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = la.num_v_heads // la.num_k_heads  # value heads per key head
        # per key head: q [Dk], k [Dk], v [r Dv], z [r Dv]; then b [r], a [r]
        qkvz = self.in_proj_qkvz(x).reshape(T, la.num_k_heads, -1)
        q, k, v, z = qkvz.split([la.k_head_dim, la.k_head_dim, r * la.v_head_dim, r * la.v_head_dim], dim=-1)
        b, a = self.in_proj_ba(x).reshape(T, la.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return (mixed, z.reshape(T, la.num_v_heads, la.v_head_dim), b.reshape(T, la.num_v_heads),
                a.reshape(T, la.num_v_heads))

    def convolve(self, mixed: torch.Tensor, st: StateMetadata) -> torch.Tensor:
        """Causal depthwise conv + SiLU per sequence, continuing from (and updating) its conv state.
        mixed: [T, C] -> [T, C]."""
        assert self.conv_state is not None
        w, keep = self.conv1d.weight, self.la.conv_kernel - 1  # w: [C, 1, K]
        C = mixed.shape[1]
        if st.host_starts[-1] == len(st.host_slots):  # one token each: one batched conv
            prev = self._previous(self.conv_state, st)  # [B, C, K-1]
            full = torch.cat([prev, mixed.unsqueeze(-1).to(prev.dtype)], dim=-1)  # [B, C, K]
            self.conv_state[st.slots] = full[:, :, -keep:]
            return F.silu(F.conv1d(full.to(w.dtype), w, groups=C)[:, :, -1]).to(mixed.dtype)
        out = torch.empty_like(mixed)
        for i, slot in enumerate(st.host_slots):
            s, e = st.host_starts[i], st.host_starts[i + 1]
            prev = self.conv_state[slot] if not st.host_fresh[i] else self.conv_state.new_zeros(C, keep)
            full = torch.cat([prev, mixed[s:e].t().to(prev.dtype)], dim=-1)  # [C, K-1+n]
            self.conv_state[slot] = full[:, -keep:]
            for at, checkpoint in st.host_saves[i] if st.host_saves else ():  # the K-1 inputs before `at`
                self._checkpoints()[0][checkpoint].copy_(full[:, at:at + keep], non_blocking=True)
            out[s:e] = F.silu(F.conv1d(full.to(w.dtype).unsqueeze(0), w, groups=C)[0].t()).to(mixed.dtype)
        return out

    def recur(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              st: StateMetadata, starts: torch.Tensor, decode: bool) -> torch.Tensor:
        """The gated delta rule from each sequence's state; writes the final states back. -> [T, Hv, Dv].
        starts: [B+1] query_start_loc on the device."""
        assert self.ssm_state is not None
        init = self._previous(self.ssm_state, st)  # [B, Hv, Dk, Dv] fp32
        kernels = fla_kernels_for(q)
        beta = beta.float() if kernels is None else beta.to(q.dtype)
        if st.host_saves:  # states inside chunks too: the sequences run in segments
            cuts = [[at for at, _ in saves] for saves in st.host_saves]
            kernel = delta_rule_torch if kernels is None else fla_prefill(kernels)
            o, final, mids = delta_rule_cut(q, k, v, g, beta, st.host_starts, cuts, init, kernel)
            for saves, states in zip(st.host_saves, mids):
                for (_, checkpoint), state in zip(saves, states):
                    self._checkpoints()[1][checkpoint].copy_(state, non_blocking=True)
        elif kernels is not None:
            o, final = delta_rule_fla(q, k, v, g, beta, starts, init, decode, kernels, st.host_starts)
        else:
            o, final = delta_rule_torch(q, k, v, g, beta, st.host_starts, init)
        self.ssm_state[st.slots] = final.to(self.ssm_state.dtype)
        return o

    def _checkpoints(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.checkpoint_conv is None or self.checkpoint_ssm is None:
            raise RuntimeError(f"linear-attention layer {self.layer} was asked to save a checkpoint but has no store")
        return self.checkpoint_conv, self.checkpoint_ssm

    @staticmethod
    def _previous(pool: torch.Tensor, st: StateMetadata) -> torch.Tensor:
        """The pool rows of the step's sequences, zero for those starting at position 0."""
        rows = pool[st.slots]
        return torch.where(st.fresh.view(-1, *([1] * (rows.dim() - 1))), torch.zeros_like(rows), rows)
