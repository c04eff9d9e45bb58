"""The training corpus: every `.py` file of the running Python's standard library.

Rules (recorded in corpus_stats.json):
- root = sysconfig.get_paths()["stdlib"]; anything under site-packages/dist-packages is excluded;
- test directories are kept (they are Python code too);
- files are decoded with their PEP 263 encoding (tokenize.detect_encoding), newlines untouched;
- exact duplicates (same bytes) are dropped, keeping the first relative path in sorted order;
- split by b = sha1(relative posix path) % 20, stable across runs: b == 0 held out (about 5%,
  only for the final loss), b == 1 validation (about 5%, watched during training to keep the
  best weights), the rest training.
"""

from __future__ import annotations

import hashlib
import io
import platform
import sys
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from tools.demo_model.config import CorpusSpec

SPLIT_MODULUS = 20
SPLIT_BUCKETS = {0: "heldout", 1: "val"}  # every other bucket is "train"
SPLITS = ("train", "val", "heldout")
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True, slots=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root
    text: str

    @property
    def is_test(self) -> bool:
        return any(part in TEST_DIRS for part in Path(self.relpath).parts[:-1])


@dataclass(slots=True)
class Corpus:
    root: str
    splits: dict[str, list[SourceFile]]  # "train", "val", "heldout" -> files sorted by relpath
    counts: dict[str, int] = field(default_factory=dict)

    def texts(self, split: str) -> list[str]:
        return [f.text for f in self.splits[split]]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """Stable split: hash of the relative path, so a file never changes side between runs."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return SPLIT_BUCKETS.get(int.from_bytes(digest, "big") % SPLIT_MODULUS, "train")


def decode_source(data: bytes) -> str:
    """Decode Python source with its declared encoding (PEP 263); raises on undecodable bytes."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    if encoding == "utf-8-sig":
        encoding = "utf-8"  # keep a BOM as text so the file round-trips byte for byte
    return data.decode(encoding)


def list_py_files(root: Path) -> list[Path]:
    """All `.py` files under `root` outside excluded directories, sorted by relative path."""
    found = []
    for path in root.rglob("*.py"):
        rel_parts = path.relative_to(root).parts
        if EXCLUDED_DIRS.intersection(rel_parts) or not path.is_file():
            continue
        found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_unique(root: Path, spec: CorpusSpec, counts: dict[str, int]) -> list[SourceFile]:
    seen: set[str] = set()
    files = []
    for path in list_py_files(root):
        relpath = path.relative_to(root).as_posix()
        data = path.read_bytes()
        counts["found"] += 1
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            counts["duplicates"] += 1
            continue
        seen.add(digest)
        try:
            text = decode_source(data)
        except (SyntaxError, UnicodeDecodeError, LookupError):
            counts["undecodable"] += 1
            continue
        source = SourceFile(relpath, text)
        if source.is_test and not spec.include_tests:
            counts["tests_skipped"] += 1
            continue
        files.append(source)
    return files


def _subset(files: list[SourceFile], limit: int | None, max_bytes: int | None) -> list[SourceFile]:
    """A stable subset (order of sha1(relpath)) for the tiny preset; the full list otherwise."""
    if limit is None and max_bytes is None:
        return files
    small = [f for f in files if max_bytes is None or len(f.text.encode("utf-8")) <= max_bytes]
    small.sort(key=lambda f: hashlib.sha1(f.relpath.encode("utf-8")).hexdigest())
    return sorted(small[:limit], key=lambda f: f.relpath)


def load_corpus(spec: CorpusSpec, root: Path | None = None) -> Corpus:
    """Read, deduplicate and split the stdlib sources of the running interpreter."""
    root = stdlib_root() if root is None else root
    if not root.is_dir():
        raise ValueError(f"stdlib root {root} is not a directory")
    counts = {"found": 0, "duplicates": 0, "undecodable": 0, "tests_skipped": 0}
    files = _read_unique(root, spec, counts)
    limits = {"train": spec.max_train_files, "val": spec.max_val_files, "heldout": spec.max_heldout_files}
    splits = {
        name: _subset([f for f in files if split_of(f.relpath) == name], limits[name], spec.max_file_bytes)
        for name in SPLITS
    }
    if not all(splits.values()):
        raise ValueError(f"corpus under {root} left a split empty: { {k: len(v) for k, v in splits.items()} }")
    counts["unique"] = len(files)
    return Corpus(root=str(root), splits=splits, counts=counts)


def corpus_stats(corpus: Corpus, spec: CorpusSpec, tokens: dict[str, int]) -> dict:
    """The JSON record of what the model was trained and evaluated on; tokens: split -> count."""
    def size(files: list[SourceFile]) -> int:
        return sum(len(f.text.encode("utf-8")) for f in files)

    splits = corpus.splits
    return {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_build": sys.version,
        "stdlib_root": corpus.root,
        "include_tests": spec.include_tests,
        "has_test_package": (Path(corpus.root) / "test" / "__init__.py").is_file(),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "dedup": "sha256 of file bytes, first relative path kept",
        "split_rule": f"b = int(sha1(relpath)) % {SPLIT_MODULUS}: b == 0 heldout, b == 1 val, else train",
        "subset": {"max_train_files": spec.max_train_files, "max_val_files": spec.max_val_files,
                   "max_heldout_files": spec.max_heldout_files, "max_file_bytes": spec.max_file_bytes},
        "files": dict(corpus.counts, **{k: len(v) for k, v in splits.items()},
                      train_test_dirs=sum(f.is_test for f in splits["train"])),
        "bytes": {k: size(v) for k, v in splits.items()},
        "tokens": dict(tokens, note="tokens include one <|endoftext|> after each file"),
        "heldout_files": [f.relpath for f in splits["heldout"]],
    }
