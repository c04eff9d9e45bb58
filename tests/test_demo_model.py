"""The bundled demo model: ferryman's held-out loss equals transformers', it is the default, it fits."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from ferryman import LLM, SamplingParams
from ferryman.errors import ConfigError
from ferryman.llm import DEMO_MODEL

WINDOW = 256


def _heldout_slice(tokenizer, n_windows: int = 3) -> list[list[int]]:
    """A fixed slice: the model card's held-out files found in this Python's stdlib, in order."""
    names = json.loads((DEMO_MODEL / "corpus_stats.json").read_text())["heldout_files"]
    root = Path(sysconfig.get_paths()["stdlib"])
    stream: list[int] = []
    for name in names:
        if (root / name).exists():
            stream += tokenizer.encode((root / name).read_text(encoding="utf-8", errors="replace"))
        if len(stream) >= n_windows * WINDOW:
            break
    assert len(stream) >= n_windows * WINDOW, "not enough held-out text in this Python's stdlib"
    return [stream[i * WINDOW : (i + 1) * WINDOW] for i in range(n_windows)]


def _nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="sum")


def test_heldout_loss_matches_transformers() -> None:
    llm = LLM(dtype="float32", device="cpu")
    windows = _heldout_slice(llm.tokenizer)
    ours = sum(_nll(lg, w) for lg, w in zip(llm.score(windows), windows)) / (len(windows) * (WINDOW - 1))
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        theirs = sum(_nll(ref(torch.tensor([w])).logits[0], w) for w in windows) / (len(windows) * (WINDOW - 1))
    assert abs(ours.item() - theirs.item()) <= 0.005 * theirs.item(), (ours.item(), theirs.item())
    assert 0.5 < theirs.item() < 6.0  # a trained model, not noise (ln 8192 = 9.0)


def test_demo_model_is_the_default_and_writes_python() -> None:
    llm = LLM(device="cpu")
    assert Path(llm.config.model) == DEMO_MODEL
    out = llm.generate(["def quicksort(xs):"], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert len(out.token_ids) > 0 and out.finish_reason in ("stop", "length")
    assert out.text == AutoTokenizer.from_pretrained(DEMO_MODEL).decode(out.token_ids, skip_special_tokens=True)
    # logits processors may keep per-sequence state: one SamplingParams is not shared by two prompts
    shared = SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ConfigError, match="one SamplingParams per prompt"):
        llm.generate(["a", "b"], shared)
    assert len(llm.generate(["a"], shared)[0].token_ids) == 2


def test_shipped_folder_is_at_most_40_mib() -> None:
    size = sum(f.stat().st_size for f in DEMO_MODEL.rglob("*") if f.is_file())
    assert size <= 40 * 2**20, f"demo model folder is {size / 2**20:.2f} MiB"


def test_yarn_frequencies_match_transformers() -> None:
    """The demo model's RoPE (YaRN, factor 16 over 2048 positions): ferryman's inverse frequencies
    and cos/sin scaling are transformers' own."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ferryman.layers.rotary import inv_freq_of
    from ferryman.models.registry import model_config
    from ferryman.weights.build import resolve_hf_config

    cfg = model_config(resolve_hf_config(str(DEMO_MODEL), "auto")[0])
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.original_max_position, cfg.max_position_embeddings) == (
        "yarn", 16.0, 2048, 32768)
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(DEMO_MODEL), "cpu")
    ours, our_scale = inv_freq_of(cfg.rope, cfg.head_dim)
    assert torch.equal(ours, theirs) and our_scale == their_scale


@pytest.mark.slow  # two 2300-token prefills in ferryman and two in transformers
def test_long_prompt_matches_transformers() -> None:
    """A prompt past the 2048 positions the model was built for: logits and greedy tokens equal
    transformers' on the YaRN-scaled config (CPU, fp32), and the default context is 32768."""
    llm = LLM(dtype="float32", device="cpu", max_num_seqs=1)
    assert llm.engine.max_model_len == 32768
    prompt = [t for w in _heldout_slice(llm.tokenizer, n_windows=10) for t in w][:2300]  # [2300]
    ref = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]  # [T, V]
        greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    got = llm.score([prompt])[0]
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"max |logit diff| {err:.3g} over {len(prompt)} positions"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = llm.generate(prompt_token_ids=[prompt], params=params)[0].token_ids
    assert greedy and ours[: len(greedy)] == greedy  # transformers stops at an eos, ours runs on
