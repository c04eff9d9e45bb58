"""llama.cpp's own converter (convert_hf_to_gguf.py from the peer kit's llama.cpp source, through the
kit's gen_gguf.py) on a tiny gpt-oss checkpoint with MXFP4 experts:

- its file equals, byte for byte, what tests/gguf_models.py + tests/gguf_harmony.py write for CI
  (every tensor's type, shape and bytes; every metadata key but general.*), so the CI tests that
  use those writers test the converter's layout;
- ferryman runs the converted file (dense tensors in F32) to transformers' greedy tokens on the
  checkpoint, with the folder's tokenizer, chat template and end ids.

Needs the peer kit (llama_src.tar.xz, gen_gguf.py) in .peer-kit/ (git-ignored) or /work/shared/peer-kit;
skipped without it. The converter imports only its own gguf-py, torch, transformers and numpy.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from ferryman import LLM, SamplingParams
from gguf_harmony import build_harmony_gpt_oss, harmony_tokenizer, same_text_handling
from gguf_models import mixed, write_gguf
from tiny_models import hf_greedy

KITS = (Path(__file__).resolve().parents[1] / ".peer-kit", Path("/work/shared/peer-kit"))
KIT = next((k for k in KITS if (k / "llama_src.tar.xz").exists() and (k / "gen_gguf.py").exists()), None)
PROMPTS = [[5, 17, 42, 7, 99], list(range(20, 33))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
pytestmark = pytest.mark.skipif(KIT is None, reason="needs the peer kit (llama.cpp source and gen_gguf.py)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """(llama.cpp source dir, tiny gpt-oss folder, its transformers model)."""
    tmp = tmp_path_factory.mktemp("converter")
    with tarfile.open(KIT / "llama_src.tar.xz") as tar:  # type: ignore[operator]
        members = [m for m in tar.getmembers()
                   if m.name.startswith(("llama.cpp/convert_hf_to_gguf.py", "llama.cpp/conversion",
                                         "llama.cpp/gguf-py"))]
        tar.extractall(tmp, members=members, filter="data")
    model = build_harmony_gpt_oss(tmp / "hf")
    return tmp / "llama.cpp", tmp / "hf", model


def convert(llama: Path, folder: Path, out: Path, outtype: str) -> Path:
    run = subprocess.run([sys.executable, str(KIT / "gen_gguf.py"), "--llama-dir", str(llama),  # type: ignore[operator]
                          "--model", str(folder), "--outfile", str(out), "--outtype", outtype],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_converter_writes_what_the_ci_writers_write(checkpoint: tuple[Path, Path, object], tmp_path: Path) -> None:
    llama, folder, _ = checkpoint
    theirs = GGUFReader(convert(llama, folder, tmp_path / "converted.gguf", "bf16"))
    ours_path = tmp_path / "ours.gguf"
    write_gguf(folder, "gpt_oss", ours_path, mixed(T.MXFP4, T.BF16), extra=harmony_tokenizer)
    ours = GGUFReader(ours_path)
    a, b = ({t.name: t for t in r.tensors} for r in (theirs, ours))
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert (x.tensor_type, x.shape.tolist()) == (y.tensor_type, y.shape.tolist()), name
        assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), name
    fa, fb = ({k: f for k, f in r.fields.items() if not k.startswith(("GGUF.", "general."))} for r in (theirs, ours))
    assert sorted(fa) == sorted(fb)
    for key in fa:
        assert (fa[key].types, fa[key].contents()) == (fb[key].types, fb[key].contents()), key


def test_converted_file_runs_as_transformers(checkpoint: tuple[Path, Path, object], tmp_path: Path) -> None:
    llama, folder, model = checkpoint
    path = convert(llama, folder, tmp_path / "converted.gguf", "f32")
    assert {t.tensor_type for t in GGUFReader(path).tensors} == {T.F32, T.MXFP4}
    llm = LLM(str(path), device="cpu", dtype="float32")
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, params=GREEDY)]
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS]  # type: ignore[arg-type]
    same_text_handling(llm, LLM(str(folder), device="cpu", dtype="float32"))
