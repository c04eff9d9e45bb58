"""Expert-cache replacement policies on the demo model's real routing, replayed through the cache's
own bookkeeping (ferryman.experts.gpu_cache.SlotTable), and next-layer guess accuracy.

    python benchmarks/bench_cache_policies.py [--model FOLDER] [--max-tokens 8192] [--json out.json]
    python benchmarks/bench_cache_policies.py --synthetic [--seqs 16] [--skew 0.0]

--synthetic replays random routing instead (no model): each decode step, each of --seqs sequences
picks top-k distinct experts per layer with weights exp(skew * N(0, 1)) fixed per expert, and a
layer looks up the union; gpt-oss-20b's shape (24 layers x 32 experts, top-4) and the 277 slots of
its 8 GiB serve plan. That is the batched decode of the dummy-weight serve benchmark, where routing
is about uniform and most of every layer is used each step.

Held-out text (tools/demo_model/routing.py: heldout_windows) is prefilled with a routing trace
and the MoE inputs recorded; the trace is then replayed as decode: one token per step, one
lookup per MoE layer (acquire the token's experts, release). Cache sizes are 10/25/50% of all
experts, as one pool over every layer (what the engine does) and as equal per-layer pools.
"guess" rows add the engine's prefetch: after layer L's lookup, layer L+1's router applied to
layer L's MoE input guesses its experts, and those not cached are admitted unreferenced.
The per-layer LRU replay is checked against tools.demo_model.trace.lru_hit_rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools.demo_model.routing import heldout_windows  # noqa: E402

from ferryman import LLM  # noqa: E402
from ferryman.experts.slot_table import SlotTable  # noqa: E402
from ferryman.experts.policies import LRFUPolicy, LRUPolicy  # noqa: E402
from tools.demo_model.trace import RoutingTrace, attach_trace, lru_hit_rate  # noqa: E402

FRACTIONS = (0.10, 0.25, 0.50)
HALF_LIVES = (2.0, 4.0, 8.0, 16.0, 64.0)


def record(llm: LLM, windows: list[list[int]]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per MoE layer: routed ids [T, K] and the guess for it from the previous layer [T, K]."""
    model = llm.engine.runner.model
    blocks = model.moe_blocks()
    inputs: dict[int, list[torch.Tensor]] = {b.layer: [] for b in blocks}
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs[m.layer].append(a[0].detach().clone()))
             for b in blocks]
    trace = RoutingTrace()
    attach_trace(model, trace)
    for w in windows:
        llm.score([w])
    attach_trace(model, None)
    for h in hooks:
        h.remove()
    ids = {layer: trace.layer(layer) for layer in trace.layers}
    guesses = {}
    with torch.no_grad():
        for prev, nxt in zip(blocks, blocks[1:]):
            x = torch.cat(inputs[prev.layer])  # [T, H]
            guesses[nxt.layer] = torch.topk(nxt.gate(x), nxt.top_k, dim=-1).indices
    return ids, guesses


def replay(ids: dict[int, list[list[int]]], guesses: dict[int, list[list[int]]], num_experts: int,
           make: callable, slots: int, per_layer: bool, prefetch: bool, width: int | None = None) -> tuple[float, float]:
    """Decode replay -> (hit rate, experts copied per expert used). Prefetched experts found in
    place count as hits; their copies (right or wrong guesses) count as traffic. width: copy only
    the guess's `width` most likely experts (the engine's one-sequence copy width)."""
    layers = sorted(ids)
    tables = ({layer: SlotTable(slots // len(layers), make()) for layer in layers} if per_layer
              else dict.fromkeys(layers, SlotTable(slots, make())))
    hits = total = prefetched = 0
    for t in range(len(ids[layers[0]])):
        for table in set(tables.values()):
            table.policy.advance()
        for i, layer in enumerate(layers):
            table, base = tables[layer], i * num_experts
            keys = [base + e for e in sorted(set(ids[layer][t]))]
            hits, total = hits + lookup_in_rounds(table, keys), total + len(keys)
            if prefetch and i + 1 < len(layers):
                nxt = layers[i + 1]
                look = tables[nxt].admit([base + num_experts + e for e in sorted(set(guesses[nxt][t][:width]))])
                prefetched += len(look.filled)
    return hits / total, (total - hits + prefetched) / total


def lookup_in_rounds(table: SlotTable, keys: list[int]) -> int:
    """Acquire and release `keys` as OffloadExperts does (cached first, rounds of the free slots)
    -> hits."""
    order = keys if len(keys) <= table.available() else sorted(keys, key=lambda k: k not in table.slot_of)
    hits = 0
    while order:
        part, order = order[: table.available()], order[table.available() :]
        hits += len(table.acquire(part).hits)
        table.release(part)
    return hits


def rank_precision(ids: dict[int, torch.Tensor], guesses: dict[int, torch.Tensor]) -> list[float]:
    """Over every layer and token: how often the guess's r-th most likely expert was used, per r."""
    right = [0] * next(iter(guesses.values())).shape[1]
    n = 0
    for layer, g in guesses.items():
        for used, ranked in zip(ids[layer].tolist(), g.tolist()):
            n += 1
            for r, e in enumerate(ranked):
                right[r] += e in used
    return [x / n for x in right]


def guess_recall(ids: dict[int, torch.Tensor], guesses: dict[int, torch.Tensor]) -> dict[int, float]:
    out = {}
    for layer, g in guesses.items():
        right = sum(len(set(a) & set(b)) for a, b in zip(ids[layer].tolist(), g.tolist()))
        out[layer] = right / ids[layer].numel()
    return out


def policies() -> dict[str, callable]:
    """lru, lrfu at each half-life (default admission), and lrfu(h=16) without / with a wider
    admission margin."""
    table: dict[str, callable] = {"lru": LRUPolicy}
    for h in HALF_LIVES:
        table[f"lrfu(h={h:g})"] = lambda h=h: LRFUPolicy(half_life=h)
    table["lrfu(h=16, no admission)"] = lambda: LRFUPolicy(half_life=16.0, admit_margin=None)
    table["lrfu(h=16, admission 0.25)"] = lambda: LRFUPolicy(half_life=16.0, admit_margin=0.25)
    return table


def synthetic(seqs: int, skew: float, steps: int, layers: int = 24, experts: int = 32, top_k: int = 4,
              seed: int = 0) -> dict[int, list[list[int]]]:
    """Per layer, per step: the union of `seqs` sequences' top-k experts, drawn without
    replacement with fixed per-expert weights exp(skew * N(0, 1))."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(skew * torch.randn(layers, experts, generator=g))  # [L, E]
    out: dict[int, list[list[int]]] = {}
    for layer in range(layers):
        picks = torch.multinomial(weights[layer].expand(steps * seqs, experts), top_k, generator=g)  # [S*B, K]
        out[layer] = [sorted(set(p.reshape(-1).tolist())) for p in picks.view(steps, seqs * top_k)]
    return out


def run_synthetic(a: argparse.Namespace) -> None:
    ids = synthetic(a.seqs, a.skew, a.steps)
    print(f"synthetic routing: {a.seqs} sequences, skew {a.skew}, {a.steps} steps, 24 layers x 32 experts, "
          f"top-4, {a.slots} slots (one pool)")
    print("| policy | hit rate | copies per expert used |")
    print("| --- | --- | --- |")
    rows = {}
    for name, make in policies().items():
        rows[name] = replay(ids, {}, 32, make, a.slots, per_layer=False, prefetch=False)
        print(f"| {name} | {rows[name][0]:.3f} | {rows[name][1]:.2f} |")
    if a.json:
        a.json.write_text(json.dumps({"seqs": a.seqs, "skew": a.skew, "hit_rates": rows}, indent=2))


def check_against_trace(ids: dict[int, torch.Tensor], num_experts: int) -> None:
    """Per-layer LRU through SlotTable == trace.lru_hit_rate (token order within a step aside)."""
    layer = sorted(ids)[0]
    rows = ids[layer].tolist()
    cap = max(ids[layer].shape[1], num_experts // 4)
    ours = replay({layer: rows}, {}, num_experts, LRUPolicy, cap, per_layer=False, prefetch=False)[0]
    theirs = lru_hit_rate(torch.tensor([sorted(r) for r in rows]), cap)
    if abs(ours - theirs) > 1e-12:
        raise SystemExit(f"SlotTable LRU {ours:.6f} != trace.lru_hit_rate {theirs:.6f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--synthetic", action="store_true", help="random routing instead of the model's (see above)")
    ap.add_argument("--seqs", type=int, default=16, help="--synthetic: sequences per decode step")
    ap.add_argument("--skew", type=float, default=0.0, help="--synthetic: spread of expert popularity (0: uniform)")
    ap.add_argument("--steps", type=int, default=300, help="--synthetic: decode steps replayed")
    ap.add_argument("--slots", type=int, default=277, help="--synthetic: cache slots")
    a = ap.parse_args()
    if a.synthetic:
        run_synthetic(a)
        return
    llm = LLM(a.model, device="cpu", dtype="float32")
    windows = heldout_windows(llm, a.max_tokens, a.window)
    ids_t, guesses_t = record(llm, windows)
    E = llm.engine.cfg.num_experts
    check_against_trace(ids_t, E)
    ids = {k: v.tolist() for k, v in ids_t.items()}
    guesses = {k: v.tolist() for k, v in guesses_t.items()}
    total = len(ids) * E
    rows: dict[str, dict[str, tuple[float, float]]] = {}
    for name, make in policies().items():
        for pool in ("global", "per-layer"):
            for prefetch in (False, True):
                label = f"{name} {pool}" + (" +guess" if prefetch else "")
                rows[label] = {f"{int(f * 100)}%": replay(ids, guesses, E, make, round(f * total),
                                                          pool == "per-layer", prefetch) for f in FRACTIONS}
    half = max(1, llm.engine.cfg.top_k // 2)
    for name in ("lru", "lrfu(h=16)"):  # the one-sequence copy width the engine starts from
        rows[f"{name} global +guess top-{half}"] = {f"{int(f * 100)}%": replay(
            ids, guesses, E, policies()[name], round(f * total), False, True, width=half) for f in FRACTIONS}
    recall = guess_recall(ids_t, guesses_t)
    tokens = sum(len(w) for w in windows)
    print(f"model: {a.model or 'bundled demo model'}; {tokens} held-out tokens replayed as decode; "
          f"{len(ids)} MoE layers x {E} experts, top-{llm.engine.cfg.top_k}")
    print("hit rate (copies per expert used) at each cache size")
    print("| policy, pool | " + " | ".join(f"{int(f * 100)}% of experts" for f in FRACTIONS) + " |")
    print("| --- |" + " --- |" * len(FRACTIONS))
    for label, r in rows.items():
        print(f"| {label} | " + " | ".join(f"{h:.3f} ({c:.2f})" for h, c in r.values()) + " |")
    print("next-layer guess recall per layer: " + ", ".join(f"{k}: {v:.3f}" for k, v in recall.items()))
    print(f"mean guess recall: {sum(recall.values()) / len(recall):.3f}")
    print("guess precision by rank (most likely first): "
          + ", ".join(f"{p:.3f}" for p in rank_precision(ids_t, guesses_t)))
    if a.json:
        a.json.write_text(json.dumps({"tokens": tokens, "hit_rates": rows, "guess_recall": recall}, indent=2))


if __name__ == "__main__":
    main()
