"""Staged zero-copy (experts/staging.py): the stage kernel under Triton's interpreter on CPU tensors
(host rows and "slots" are two CPU buffers), then the decode kernel reading the staged addresses;
and on CUDA, staged zero-copy decode against resident answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from triton_interp import run_interpreted

_SCRIPT = """
import json, torch
from ferryman.experts.host_store import ExpertLayout
from ferryman.experts.staging import RowStager
from ferryman.layers.fused_moe import MoEActivation, fused_moe_reference
from ferryman.layers.fused_moe_triton import DecodeConfig, RowAddresses, fused_moe_decode
from ferryman.quant import get_format

class Table:  # the part of RowAddressTable the stager reads
    def __init__(self, addr, row_bytes):
        self.addr, self.row_bytes, self.num_experts, self.device = addr, row_bytes, addr.numel(), addr.device
    def layer(self, index):
        return self.addr

e, h, i, t, k = 6, 96, 64, 2, 2
form = get_format("mxfp4")
gen = torch.Generator().manual_seed(0)
banks = form.random_banks(e, h, i, True, torch.float32, gen)
layout = ExpertLayout.of(form.bank_specs(e, h, i, True, torch.float32))
slots = torch.zeros(e // 2, layout.row_bytes, dtype=torch.uint8)
host = torch.zeros(e - e // 2, layout.row_bytes, dtype=torch.uint8)
addr = torch.zeros(e, dtype=torch.int64)
for ex in range(e):  # odd experts in "slots", even ones in "host memory"
    buf, r = (slots, ex // 2) if ex % 2 else (host, ex // 2)
    views = layout.views(buf[r : r + 1])
    for name, bank in banks.items():
        views[name][0].copy_(bank[ex])
    addr[ex] = buf.data_ptr() + r * layout.row_bytes
table = Table(addr, layout.row_bytes)
stager = RowStager(table, slots.data_ptr(), slots.data_ptr() + slots.numel(), rows=t * k)
stager.buf.zero_()
ids = torch.tensor([[0, 3], [0, 4]], dtype=torch.int32)  # expert 0 twice (host), 3 (slot), 4 (host)
staged = stager.stage(0, ids)
out = {}
rows = stager.buf.view(torch.uint8)
base = stager.buf.data_ptr()
rb = layout.row_bytes
out["slot_kept"] = int(staged[3]) == int(addr[3]) and int(staged[1]) == int(addr[1])
out["unused_kept"] = int(staged[2]) == int(addr[2])  # a host expert no pair names stays where it is
out["e0_row"] = (int(staged[0]) - base) // rb  # the first pair naming expert 0: pair 0
out["e4_row"] = (int(staged[4]) - base) // rb  # pair 3
out["e0_bytes"] = bool(torch.equal(rows[0], host[0]))
out["e4_bytes"] = bool(torch.equal(rows[3], host[2]))
out["untouched"] = bool((rows[1] == 0).all() and (rows[2] == 0).all())  # pair 1 repeats expert 0; pair 2 is a slot
x = torch.randn(t, h, generator=gen)
w = torch.softmax(torch.randn(t, k, generator=gen), -1)
act = MoEActivation("swiglu_oai")
ref = fused_moe_reference(form, banks, x, ids, w, act)
got = fused_moe_decode("mxfp4", layout.views(slots), x, ids, w, act.kind, act.alpha, act.limit,
                       DecodeConfig(block_n=64, block_k=64), RowAddresses(staged, layout.offsets))
out["err"] = ((got - ref).norm() / ref.norm()).item()
print(json.dumps(out))
"""


def test_stage_copies_host_rows_once_and_the_decode_reads_them() -> None:
    got = json.loads(run_interpreted(_SCRIPT).strip().splitlines()[-1])
    assert got["slot_kept"] and got["unused_kept"], got
    assert got["e0_row"] == 0 and got["e4_row"] == 3, got  # the first pair naming each host expert
    assert got["e0_bytes"] and got["e4_bytes"] and got["untouched"], got
    assert got["err"] < 1e-5, got


def test_stager_checks_its_inputs() -> None:
    from ferryman.experts.staging import RowStager

    class Table:
        row_bytes, num_experts, device = 4096, 4, torch.device("cpu")

    with pytest.raises(ValueError, match="at least 1 staging row"):
        RowStager(Table(), 0, 1, rows=0)  # type: ignore[arg-type]
    Table.row_bytes = 4094
    with pytest.raises(ValueError, match="4-byte words"):
        RowStager(Table(), 0, 1, rows=2)  # type: ignore[arg-type]


def test_staging_rows_come_out_of_the_slots_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferryman import LLM
    from ferryman.errors import ConfigError

    monkeypatch.setenv("FERRYMAN_ZERO_COPY", "1")
    monkeypatch.setenv("FERRYMAN_ZERO_COPY_STAGE", "100000")
    with pytest.raises(ConfigError, match="FERRYMAN_ZERO_COPY_STAGE must be 0"):
        LLM(device="cpu", moe_strategy="offload", expert_cache=32)


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [1, 3])
def test_cuda_staged_zero_copy_decode_equals_resident(tiny: tuple[str, Path], seqs: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged zero-copy decode with top-k staging rows (one sequence's pairs are staged; steps of
    three sequences are not and read host rows directly) gives the resident answers."""
    from ferryman import LLM
    from ferryman.config import ModelConfig
    from tiny_models import greedy_ids

    arch, folder = tiny
    top_k = ModelConfig.from_hf(folder).top_k
    prompts = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]][:seqs]
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64)
    want = greedy_ids(LLM(str(folder), enforce_eager=True, **kw), prompts, 12)
    monkeypatch.setenv("FERRYMAN_ZERO_COPY", "1")
    monkeypatch.setenv("FERRYMAN_ZERO_COPY_STAGE", str(top_k))
    llm = LLM(str(folder), moe_strategy="offload", expert_cache="25%", max_num_seqs=4, **kw)
    stager = llm.engine.runner.experts.stager
    assert stager is not None and stager.rows == top_k
    stager.buf.zero_()  # graph replays write the same rows
    assert greedy_ids(llm, prompts, 12) == want, f"{arch}: staged zero-copy decode differs from resident"
    if seqs == 1:  # a host row was staged (a 25% cache misses most experts)
        assert bool(stager.buf.any())
