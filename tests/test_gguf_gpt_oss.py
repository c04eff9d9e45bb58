"""gpt-oss as llama.cpp's converter writes it (tests/gguf_models.py, tests/gguf_harmony.py: tensor
names, the MXFP4 nibble re-layout, gate/up split from their interleaved rows, biases and sinks in
F32, yarn betas, the tokenizer and chat template in the metadata), against the folder it came from.

Greedy tokens equal transformers running the checkpoint (CPU, fp32: dense tensors kept F32, the
MXFP4 experts as they are); the tokenizer, chat template and end-of-generation ids built from the
file's metadata equal those ferryman reads from the folder's tokenizer files. With BF16 dense
tensors (the converter's default for a bf16 checkpoint) tests/test_gguf.py checks the GGUF path
against the safetensors path bit for bit.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as T

from ferryman import LLM, SamplingParams
from gguf_harmony import build_harmony_gpt_oss, harmony_tokenizer, same_text_handling
from gguf_models import mixed, write_gguf
from tiny_models import hf_greedy

PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_gpt_oss_gguf_matches_transformers(tmp_path: Path) -> None:
    model = build_harmony_gpt_oss(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(tmp_path / "hf", "gpt_oss", path, mixed(T.MXFP4, T.F32), extra=harmony_tokenizer)
    llm = LLM(str(path), device="cpu", dtype="float32")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]
    same_text_handling(llm, LLM(str(tmp_path / "hf"), device="cpu", dtype="float32"))


def test_gpt_oss_gguf_offloaded_equals_resident(tmp_path: Path) -> None:
    """The converted layout through the offload path (a few slots: misses copy MXFP4 rows, biases
    beside them) gives the resident tokens."""
    build_harmony_gpt_oss(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(tmp_path / "hf", "gpt_oss", path, mixed(T.MXFP4, T.BF16), extra=harmony_tokenizer)
    resident = LLM(str(path), device="cpu", dtype="float32")
    want = [o.token_ids for o in resident.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    off = LLM(str(path), device="cpu", dtype="float32", moe_strategy="offload", expert_cache=5)
    assert [o.token_ids for o in off.generate(prompt_token_ids=PROMPTS, params=GREEDY)] == want
    assert off.engine.runner.experts.cache.counters.misses
