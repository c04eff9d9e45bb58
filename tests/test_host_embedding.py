"""The token-embedding table in host RAM (offloaded plans; weights/build.py, MoETransformer.embed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferryman.engine.cuda_graph import StaticDecodeInputs
from ferryman.weights.build import build_model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import build_tiny

    folder = tmp_path_factory.mktemp("gpt_oss_host_embedding")
    build_tiny("gpt_oss", folder)
    return folder


def test_build_keeps_the_table_apart_and_loads_it(gpt_oss: Path) -> None:
    """Built with host_embedding the table is materialised on the host on its own (the rest of the
    tree goes to the device) and loaded with the same values."""
    ref = build_model(str(gpt_oss), torch.device("cpu"), dtype="float32")
    host = build_model(str(gpt_oss), torch.device("cpu"), dtype="float32", host_embedding=True)
    assert not host.cfg.tie_word_embeddings
    assert host.model.embed_tokens.weight.device.type == "cpu"
    assert torch.equal(host.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(host.model.lm_head.weight, ref.model.lm_head.weight)
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(host.model.embed(ids, ids.clone()), ref.model.embed_tokens(ids))


def test_static_inputs_have_no_embeds_buffer_when_the_table_is_on_the_device(gpt_oss: Path) -> None:
    loaded = build_model(str(gpt_oss), torch.device("cpu"), dtype="float32", host_embedding=True)
    st = StaticDecodeInputs(4, 2, 32, torch.device("cpu"), loaded.model)
    assert st.embeds is None and st.token_embeds(2) is None  # the CPU is the device: one place


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_table_rows_equal_the_device_lookup(gpt_oss: Path) -> None:
    dev = build_model(str(gpt_oss), torch.device("cuda"), dtype="bfloat16")
    host = build_model(str(gpt_oss), torch.device("cuda"), dtype="bfloat16", host_embedding=True)
    assert host.model.embed_tokens.weight.device.type == "cpu" and host.model.lm_head.weight.is_cuda
    ids = torch.tensor([7, 0, 255, 7])
    want = dev.model.embed_tokens(ids.cuda())
    assert torch.equal(host.model.embed(ids.cuda(), ids), want)
    assert torch.equal(host.model.embed(ids.cuda()), want)  # no host ids: read back once
    st = StaticDecodeInputs(4, 2, 32, torch.device("cuda"), host.model)
    assert st.embeds is not None and st.embeds.shape == (4, host.cfg.hidden_size)
