"""Held-out loss by position of an exported demo model, with its shipped RoPE and with plain RoPE.

    python -m tools.demo_model.context_eval --model ferryman/assets/demo-moe

Reads the held-out files of `corpus_stats.json` found in this Python's stdlib (transformers, fp32,
CPU): the mean next-token loss over `--windows` windows of 512 tokens, and by position in one
`--long`-token stream of those files. The model card's "Context" table comes from here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

WINDOW = 512


def heldout_stream(model: Path) -> list[int]:
    """The held-out files found in this stdlib, tokenised, each followed by <|endoftext|> (id 0)."""
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    stream: list[int] = []
    for name in json.loads((model / "corpus_stats.json").read_text())["heldout_files"]:
        if (root / name).exists():
            stream += tok.encode((root / name).read_text(encoding="utf-8", errors="replace")) + [0]
    return stream


def plain_rope_copy(model: Path, out: Path) -> Path:
    """A copy of the folder whose config has plain RoPE over the built-for positions."""
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    rope = config["rope_parameters"]
    config["max_position_embeddings"] = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@torch.no_grad()
def losses(folder: Path, windows: torch.Tensor, long: torch.Tensor, bounds: list[int]) -> list[float]:
    """[loss over the windows, then the long stream's mean loss between consecutive bounds]."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    total = 0.0
    for start in range(0, len(windows), 8):
        ids = windows[start:start + 8]  # [B, 512]
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum").item()
    nll = F.cross_entropy(model(input_ids=long[None], use_cache=False).logits[0, :-1], long[1:], reduction="none")
    return [total / (len(windows) * (WINDOW - 1))] + [nll[a:b].mean().item() for a, b in zip(bounds, bounds[1:])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("ferryman/assets/demo-moe"))
    p.add_argument("--windows", type=int, default=100, help="512-token windows (default: 100)")
    p.add_argument("--long", type=int, default=8192, help="tokens of the long stream (default: 8192)")
    a = p.parse_args()
    stream = heldout_stream(a.model)
    n = min(a.windows, len(stream) // WINDOW)
    windows = torch.tensor([stream[i * WINDOW:(i + 1) * WINDOW] for i in range(n)])
    long = torch.tensor(stream[:a.long])
    bounds = [0, 512, 2048, 4096, a.long - 1]
    print(f"{n} windows of {WINDOW}; one stream of {len(long)} tokens, loss by position {bounds}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, folder in (("shipped", a.model), ("plain RoPE", plain_rope_copy(a.model, Path(tmp) / "m"))):
            print(label, " ".join(f"{x:.3f}" for x in losses(folder, windows, long, bounds)), flush=True)


if __name__ == "__main__":
    main()
