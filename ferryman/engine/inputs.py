"""Turn a `SchedulerOutput` into the flat tensors one forward pass consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferryman.engine.sched_types import ScheduledSeq, SchedulerOutput
from ferryman.layers.attn_metadata import StateMetadata
from ferryman.layers.paged_attention import AttnMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, the tokens of every scheduled sequence, packed
    positions: torch.Tensor  # [T] int64
    meta: AttnMetadata
    logits_indices: torch.Tensor  # [B_s] int64, row of the last token of each sampling sequence
    sample_seq_ids: list[int]  # seq ids in the order of logits_indices
    host_ids: torch.Tensor  # [T] int64 input_ids on the host (a host embedding table reads them)


def _slots(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Cache slots (block * S + offset) of positions start .. start + n - 1."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


def _saves_at(out: SchedulerOutput, slots: list[int]) -> list[list[tuple[int, int]]] | None:
    """out.state_saves_at per scheduled sequence (slots: their state slots): ascending (offset, checkpoint)."""
    if not out.state_saves_at:
        return None
    row = {slot: i for i, slot in enumerate(slots)}
    saves: list[list[tuple[int, int]]] = [[] for _ in slots]
    for slot, checkpoint, offset in out.state_saves_at:
        saves[row[slot]].append((offset, checkpoint))
    return [sorted(s) for s in saves]


def prepare_inputs(out: SchedulerOutput, block_size: int, device: torch.device, window_kv: bool = False,
                   window_tables: dict[int, list[int]] | None = None) -> StepInputs:
    """window_kv: the sliding-window layers have a pool of their own (kvcache/window_pool.py); their
    tables and slots go in the metadata's window_* fields. window_tables: seq_id -> the window table
    to use instead of the sequence's (a layer-major job's ring, engine/layer_prefill.py)."""
    def window_table(s: ScheduledSeq) -> list[int]:
        return s.seq.window_table if window_tables is None else window_tables[s.seq.seq_id]

    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    window_slots: list[int] = []
    logits_idx: list[int] = []
    sample_ids: list[int] = []
    for s in out.scheduled:
        start, n, table = s.start_pos, s.num_tokens, s.seq.block_table
        ids.extend(s.token_ids)
        positions.extend(range(start, start + n))
        slots.extend(_slots(table, start, n, block_size))
        if window_kv:
            window_slots.extend(_slots(window_table(s), start, n, block_size))
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(table)
        if s.sample:
            logits_idx.append(qsl[-1] - 1)
            sample_ids.append(s.seq.seq_id)
    def t(x: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    meta = AttnMetadata(
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=t(_padded(tables), torch.int32),
        slot_mapping=t(slots, torch.int64),
        max_query_len=max(s.num_tokens for s in out.scheduled),
        max_seq_len=max(seq_lens),
    )
    if out.scheduled[0].seq.state_slot >= 0:  # a hybrid model: every sequence holds a state slot
        slots = [s.seq.state_slot for s in out.scheduled]
        fresh = [s.start_pos == 0 for s in out.scheduled]
        meta.state = StateMetadata(t(slots, torch.int64), t(fresh, torch.bool), qsl, slots, fresh,
                                   _saves_at(out, slots))
    if window_kv:
        meta.window_block_tables = t(_padded([window_table(s) for s in out.scheduled]), torch.int32)
        meta.window_slot_mapping = t(window_slots, torch.int64)
    host_ids = torch.tensor(ids, dtype=torch.int64)  # fresh: the async copy stages it at once
    return StepInputs(host_ids.to(device, non_blocking=True), t(positions, torch.int64), meta,
                      t(logits_idx, torch.int64), sample_ids, host_ids)
