"""The demo model's chat fine-tune data (tools/demo_model/chat_data.py), checked against the
shipped tokenizer's own chat template (transformers), the server's rendering of tools
(ferryman/server/chat.py) and the stdlib's sources; and the chat stage end to end on the tiny build."""

from __future__ import annotations

import json
import random
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tools` is not an installed package

from ferryman.llm import DEMO_MODEL  # noqa: E402
from ferryman import LLM, SamplingParams  # noqa: E402
from ferryman.server.chat import ChatRenderer  # noqa: E402
from tools.demo_model import build  # noqa: E402
from tools.demo_model.chat_agent import material, tools_block  # noqa: E402
from tools.demo_model.chat_data import IGNORE, chat_samples, encode_conversation, render  # noqa: E402
from tools.demo_model.chat_eval import ferryman_turns, hf_turns  # noqa: E402
from tools.demo_model.chat_mix import MixSpec, mixed_samples  # noqa: E402
from tools.demo_model.chat_stage import check_context  # noqa: E402
from tools.demo_model.chat_tune import ChatSpec, Schedule  # noqa: E402
from tools.demo_model.config import hf_config, tiny_spec  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ("textwrap.py", "shlex.py", "bisect.py", "colorsys.py", "argparse.py", "json/decoder.py", "csv.py")


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


def _stdlib_texts() -> tuple[list[str], list[str]]:
    names = [f for f in FILES if (STDLIB / f).exists()]
    return [(STDLIB / f).read_text(encoding="utf-8") for f in names], names


def test_every_assistant_message_is_trained_with_its_end() -> None:
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    messages = [("system", "Be brief."), ("user", "Read x.py"),
                ("assistant", '<tool_call>\n{"name": "read_file", "arguments": {"file_path": "x.py"}}\n</tool_call>'),
                ("user", "<tool_response>\ndef f():\n    return 1\n</tool_response>"), ("assistant", "It defines f.")]
    s = encode_conversation(tok, messages, end)
    trained = [i for i, label in enumerate(s.labels) if label != IGNORE]
    runs, run = [], [trained[0]]
    for i in trained[1:]:
        if i == run[-1] + 1:
            run.append(i)
        else:
            runs.append(run)
            run = [i]
    runs.append(run)
    texts = [tok.decode([s.ids[i] for i in r], skip_special_tokens=False) for r in runs]
    assert texts == [c + "<|im_end|>" for role, c in messages if role == "assistant"]
    # the prompt is everything before the last answer, generation prompt included
    assert tok.decode(s.ids[:s.prompt_len], skip_special_tokens=False) == render(messages[:-1], True)


def test_long_system_messages_are_agent_sized_and_use_the_servers_tools_block() -> None:
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    texts, names = _stdlib_texts()
    mix = MixSpec(short_len=512, long_min=4096, long_max=8192)
    short, long = mixed_samples(tok, texts, names, mix, seed=3, end_id=end, short=16, long=6)
    assert len(short) >= 8 and len(long) >= 4
    assert all(len(s.ids) <= 512 for s in short)
    assert all(3000 < len(s.ids) <= 8192 + 512 for s in long)
    assert mixed_samples(tok, texts, names, mix, seed=3, end_id=end, short=16, long=6) == (short, long)  # seeded
    # the tools block is the one ferryman serve appends for a template without tools
    m = material(texts, names)
    block = tools_block(random.Random(0), m, 5)
    tools = [json.loads(line) for line in block.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()]
    hf_tok = AutoTokenizer.from_pretrained(DEMO_MODEL, local_files_only=True)
    served = ChatRenderer(hf_tok).render([{"role": "user", "content": "hi"}], tools).text
    assert served == render([("system", block), ("user", "hi")], True)


def test_batches_hold_the_token_budget_and_both_kinds() -> None:
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    texts, names = _stdlib_texts()
    spec = ChatSpec(step_tokens=4096, max_rows=16, long_share=0.5, plain_rows=2, plain_len=64,
                    mix=MixSpec(short_len=512, long_min=1024, long_max=2048))
    short, long = mixed_samples(tok, texts, names, spec.mix, seed=5, end_id=end, short=40, long=6)
    plain = torch.randint(3, 100, (10, 64))
    schedule = Schedule(short, long, plain, spec, pad_id=0)
    kinds = set()
    for _ in range(30):
        ids, labels, kind = schedule.next()
        kinds.add(kind)
        chat_rows = ids.size(0) - (2 if kind == "short" else 0)
        assert chat_rows * ids.size(1) <= 4096 or chat_rows == 1
        assert ids.shape == labels.shape and (labels != IGNORE).any()
    assert kinds == {"short", "long"}


def test_tiny_build_with_chat_stage_records_both_prompt_kinds(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    assert build.main(["--out", str(out), "--tiny", "--device", "cpu", "--max-steps", "10", "--chat-minutes", "1"]) == 0
    record = json.loads((out / "training_log.json").read_text())["chat"]
    assert record["train"]["steps"] == 6 and record["spec"]["train_layers"] == 0
    for when in ("before", "after"):
        turns = record[when]["turns"]
        assert turns["engine"] == "ferryman (cpu)"
        assert turns["short"]["prompts"] >= 1 and turns["long_system"]["prompts"] >= 1
        assert turns["long_system"]["prompt_tokens"][0] > turns["short"]["prompt_tokens"][0]
    card = (out / "README.md").read_text()
    assert "## Chat turns" in card and "long-system-message prompts" in card
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # the export loads back
    assert model.config.max_position_embeddings >= 1536 + 384


def test_context_check_refuses_samples_beyond_the_positions() -> None:
    config = hf_config(tiny_spec().model, 0)
    model = Qwen3MoeForCausalLM(config)
    check_context(model, config.max_position_embeddings, lambda _: None)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_context(model, config.max_position_embeddings + 1, lambda _: None)


def test_transformers_fallback_agrees_with_ferryman(tmp_path: Path) -> None:
    """The measure the stage falls back to (transformers' generate, left-padded batches) gives the
    same answers' ends as ferryman on the same prompts (greedy, fp32, CPU)."""
    out = tmp_path / "demo"
    assert build.main(["--out", str(out), "--tiny", "--device", "cpu", "--max-steps", "10"]) == 0
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompts = [tok.encode(render([("user", f"def f{i}(x):" + " pass" * i)], True)).ids for i in range(5)]
    prompts.append(tok.encode(render([("system", "Be brief."), ("user", "hi")], True)).ids)
    cpu = torch.device("cpu")
    free = LLM(str(out), device="cpu", dtype="float32").generate(
        prompt_token_ids=prompts, params=SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stops = sorted({0, 2} | {o.token_ids[5] for o in free[:3]})  # tokens the model writes, so answers end
    a = ferryman_turns(out, prompts, 24, cpu, stops)
    b = hf_turns(out, prompts, 24, cpu, stops, pad_id=0)
    assert 0 < a["ended"] and a["prompts"] == len(prompts)
    assert a == b
