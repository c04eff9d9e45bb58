"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, greedy and seeded rows.

Semantics follow transformers' logits processors (order: repetition penalty, temperature, top-k,
top-p, min-p) plus OpenAI presence / frequency penalties applied right after the repetition
penalty (vLLM's order). Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) i.i.d.
picks token i with probability p_i. Rows of seeded sequences draw q from the sequence's own
generator, so a seed gives the same tokens whatever else is in the batch. A sequence's own logits
processors (SamplingParams.logits_processors) run first; logprobs come from the raw logits.
"""

from __future__ import annotations

import torch

from ferryman.engine.outputs import SamplerOutput, TokenLogprobs
from ferryman.engine.sequence import Sequence
from ferryman.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class Sampler:
    """`sample(logits[B, V] fp32, seqs) -> SamplerOutput` (the runner's entry point: each row's logits
    processors, logprobs, the draw); `sampler(logits, seqs) -> Tensor[B]` is the draw alone."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [B, V] with B = {len(seqs)} sequences, "
                             f"got shape {tuple(logits.shape)}")
        logits = apply_penalties(logits.float(), seqs)  # [B, V]
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        logits = logits / _column([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                  logits)
        logits = apply_filters(logits, params)
        tokens = sample_exponential_race(logits.softmax(dim=-1), seqs)  # [B]
        if any(greedy):
            greedy_rows = torch.tensor(greedy, device=logits.device)
            tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
        return tokens

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [B, V] fp32, raw -> each sequence's token (after its logits processors), and the
        raw distribution's logprobs for the sequences whose params ask for them."""
        tokens = self(apply_logits_processors(logits, seqs), seqs)  # [B]
        out = SamplerOutput(dict(zip((s.seq_id for s in seqs), tokens.tolist())))
        top_n = [s.params.logprobs for s in seqs]
        if any(n is not None for n in top_n):
            lps = token_logprobs(logits, tokens, top_n)
            out.logprobs = {s.seq_id: lp for s, lp in zip(seqs, lps) if lp is not None}
        return out


def apply_logits_processors(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [B, V] -> [B, V], each row through its sequence's processors (a copy when any runs)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logits_processors]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        row = out[i]  # [V]
        for proc in seqs[i].params.logits_processors:
            row = proc(seqs[i].output_token_ids, row)
        out[i] = row
    return out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[B] python values -> [B, 1] tensor on the device of `like`."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _padded_ids(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Ragged token ids -> [B, L] int64, padded (and out-of-vocab ids mapped) to `vocab`."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), vocab, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return ids.clamp_(0, vocab).to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [B, V] -> [B, V] with repetition (prompt + output tokens, HF semantics) and
    presence / frequency (output tokens, OpenAI semantics) penalties."""
    B, V = logits.shape
    rep = [s.params.repetition_penalty for s in seqs]
    pres = [s.params.presence_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    if any(r != 1.0 for r in rep):
        rows = [s.all_token_ids if r != 1.0 else [] for s, r in zip(seqs, rep)]
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, _padded_ids(rows, V, logits.device), True)  # column V collects padding
        r = _column(rep, logits)
        penalized = torch.where(logits < 0, logits * r, logits / r)
        logits = torch.where(seen[:, :V], penalized, logits)
    if any(p != 0.0 or f != 0.0 for p, f in zip(pres, freq)):
        rows = [s.output_token_ids if p != 0.0 or f != 0.0 else [] for s, p, f in zip(seqs, pres, freq)]
        ids = _padded_ids(rows, V, logits.device)
        counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :V]
        logits = logits - _column(freq, logits) * counts - _column(pres, logits) * (counts > 0)
    return logits


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [B, V] (temperature applied) -> [B, V] with the tokens each row's top_k / top_p /
    min_p drop set to -inf (k <= 0, p = 1, min_p = 0 leave a row alone). The most likely token
    always survives."""
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0.0 for p in params)
    if not (use_top_k or use_top_p or use_min_p):
        return logits
    V = logits.shape[1]
    # Work in descending order: sorted_logits[:, 0] is each row's most likely token.
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_top_k:
        top_k = torch.tensor([min(p.top_k, V) if p.top_k > 0 else V for p in params], device=logits.device)  # [B]
        # Like HF: tokens tied with the k-th largest logit are kept.
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [B, 1]
        remove |= sorted_logits < kth
    if use_top_p:
        probs = sorted_logits.masked_fill(remove, _NEG_INF).softmax(dim=-1)
        # HF drops a token when the mass of it and every less likely token is <= 1 - top_p.
        mass_from_tail = probs.flip(-1).cumsum(dim=-1).flip(-1)  # [B, V]
        remove |= mass_from_tail <= 1.0 - _column([p.top_p for p in params], logits)
    if use_min_p:
        probs = sorted_logits.masked_fill(remove, _NEG_INF).softmax(dim=-1)
        remove |= probs < _column([p.min_p for p in params], logits) * probs[:, :1]
    remove[:, 0] = False
    return logits.masked_fill(remove.scatter(1, order, remove), _NEG_INF)


def sample_exponential_race(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """probs: [B, V] -> [B] int64 sampled ids; rows of seeded sequences use their own generator."""
    q = torch.empty_like(probs).exponential_()  # [B, V]
    for i, seq in enumerate(seqs):
        gen = seq.generator(probs.device)
        if gen is not None and not seq.params.greedy:
            q[i].exponential_(generator=gen)
    # A draw of exactly 0 would turn a zero-probability token into 0/0 = nan, which argmax picks.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]
                   ) -> list[TokenLogprobs | None]:
    """Log-probabilities of the model's distribution (raw logits, before penalties, temperature and
    filters, like vLLM) for the chosen tokens and each row's `top_n` most likely tokens.

    logits: [B, V] fp32, tokens: [B]; rows whose top_n is None give None."""
    rows = [i for i, n in enumerate(top_n) if n is not None]
    if not rows:
        return [None] * len(top_n)
    idx = torch.tensor(rows, device=logits.device)
    logp = logits[idx].float().log_softmax(dim=-1)  # [R, V]
    chosen = logp.gather(1, tokens[idx].view(-1, 1)).squeeze(1).tolist()  # [R]
    k = max(top_n[i] for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    vals, ids = top_vals.tolist(), top_ids.tolist()  # one read back each, not two per row
    out: list[TokenLogprobs | None] = [None] * len(top_n)
    for r, i in enumerate(rows):
        out[i] = (chosen[r], list(zip(ids[r][: top_n[i]], vals[r][: top_n[i]])))
    return out
