"""Zero-copy decode (FERRYMAN_ZERO_COPY): decode kernels read uncached experts from pinned host
memory through the row-address table (experts/row_addresses.py), so decode steps are whole CUDA
graphs; prefill still goes through the slot cache and fills it. The answer must not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferryman import LLM
from ferryman.errors import ConfigError
from tiny_models import greedy_ids

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33)), [(i * 37) % 250 + 3 for i in range(29)]]


def test_zero_copy_needs_cuda(tiny: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, folder = tiny
    monkeypatch.setenv("FERRYMAN_ZERO_COPY", "1")
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        LLM(str(folder), device="cpu", moe_strategy="offload", expert_cache="25%")


@pytest.mark.gpu
def test_zero_copy_decode_equals_resident(tiny: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    arch, folder = tiny
    # the three prompts prefill in one step of 47 tokens (> 64 pairs: the cache path, which fills it)
    kw = dict(device="cuda", dtype="float32", max_num_batched_tokens=64)
    want = greedy_ids(LLM(str(folder), enforce_eager=True, **kw), PROMPTS, 12)
    monkeypatch.setenv("FERRYMAN_ZERO_COPY", "1")
    offload = LLM(str(folder), moe_strategy="offload", expert_cache="25%", max_num_seqs=4, **kw)
    st = offload.stats()
    assert st["cuda_graph_mode"] == "step" and st["experts"]["zero_copy"]
    assert greedy_ids(offload, PROMPTS, 12) == want, f"{arch}: zero-copy decode differs from resident"
    ex = offload.stats()["experts"]
    assert ex["misses"] > 0 and ex["bytes_h2d"] > 0  # prefill chunks went through the cache
    # decode reads were counted after each (graph-replayed) step: 11 decode steps x every MoE layer
    layers = len(offload.engine.cfg.moe_layers)
    assert ex["hits"] + ex["misses"] >= 11 * layers
