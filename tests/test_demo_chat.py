"""The demo model's chat fine-tune data (tools/demo_model/chat_data.py), checked against the
shipped tokenizer's own chat template (transformers) and the stdlib's sources."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tools` is not an installed package

from ferryman.llm import DEMO_MODEL  # noqa: E402
from tools.demo_model.chat_data import IGNORE, chat_samples, render  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ("textwrap.py", "shlex.py", "bisect.py", "colorsys.py")


def test_render_is_the_models_chat_template() -> None:
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL, local_files_only=True)
    messages = [("system", "Be brief."), ("user", "def add(a, b):")]
    as_dicts = [{"role": r, "content": c} for r, c in messages]
    assert render(messages, True) == tok.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=True)
    assert render(messages, False) == tok.apply_chat_template(as_dicts, tokenize=False)


def test_samples_train_on_the_answer_and_its_end_only() -> None:
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    texts = [(STDLIB / f).read_text(encoding="utf-8") for f in FILES if (STDLIB / f).exists()]
    samples = chat_samples(tok, texts, seed=1, max_len=192, end_id=end, count=8)
    assert len(samples) == 8
    assert chat_samples(tok, texts, seed=1, max_len=192, end_id=end, count=8) == samples  # seeded
    for s in samples:
        trained = [i for i, label in enumerate(s.labels) if label != IGNORE]
        # labels are a contiguous run right after the generation prompt, ending with <|im_end|>
        assert trained == list(range(s.prompt_len, trained[-1] + 1)) and s.labels[trained[-1]] == end
        assert [s.labels[i] for i in trained] == s.ids[trained[0]:trained[-1] + 1]
        prompt = tok.decode(s.ids[:s.prompt_len], skip_special_tokens=False)
        assert prompt.endswith("<|im_start|>assistant\n") and len(s.ids) <= 192
        answer = tok.decode(s.ids[s.prompt_len:trained[-1]], skip_special_tokens=False)
        assert "<|im_" not in answer and answer.strip()
