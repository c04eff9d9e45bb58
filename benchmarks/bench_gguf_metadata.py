"""Opening a GGUF file with a large vocabulary: ferryman's reader (weights/gguf_reader.py) against
gguf-py's GGUFReader, which it replaced.

    python benchmarks/bench_gguf_metadata.py [--vocab 201088] [--merges 446000] [--reps 3]

Writes a metadata-only GGUF with a byte-level vocabulary of --vocab tokens and --merges merges (gpt-oss
ships 201,088 and about 446,000) to a temporary folder, then times opening it with each reader (best
of --reps) and checks that both read the same vocabulary.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gguf import GGUFReader, GGUFWriter

from ferryman.weights.gguf_reader import GGUFFile


def write(path: Path, vocab: int, merges: int) -> None:
    tokens = [f"t{i}" for i in range(vocab)]
    w = GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"t{i % vocab} t{(i * 7) % vocab}" for i in range(merges)])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def best(fn: type, path: Path, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=201088, help="tokens (default: gpt-oss's)")
    ap.add_argument("--merges", type=int, default=446000, help="merges (default: about gpt-oss's)")
    ap.add_argument("--reps", type=int, default=3, help="opens per reader; the best counts")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        write(path, a.vocab, a.merges)
        ours, ref = best(GGUFFile, path, a.reps), best(GGUFReader, path, a.reps)
        same = GGUFFile(path).get_field("tokenizer.ggml.merges") == \
            GGUFReader(path).get_field("tokenizer.ggml.merges").contents()
        print(f"{a.vocab:,} tokens, {a.merges:,} merges, {path.stat().st_size / 2**20:.1f} MiB: ferryman {ours:.2f} s, "
              f"gguf-py {ref:.2f} s ({ref / ours:.1f}x); same merges: {same}")


if __name__ == "__main__":
    main()
