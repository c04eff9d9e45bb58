"""Copy the peer kit's load clients (bench_client.py, load_client.py) into DEST with two fixes that
let them measure any server on a random-weight model's vocabulary:

1. calibration: the first guess of words per prompt comes from a 100-word probe instead of 2 tokens
   per word (a random vocabulary may split a word into 5 tokens: the first request then exceeded
   the server's context and came back 400);
2. a streamed chunk counts as a token when it carries a `text` field, even an empty one (llama-server
   sends an empty text for a token that ends inside a UTF-8 character or is a control token: with
   random weights its whole output can be such tokens, and time to first token was never seen).

    python tools/peer_client.py PEER_KIT DEST

Each fix replaces one exact line; a kit whose line differs fails here, naming the file and line.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

FIXES = {
    "bench_client.py": [
        ("    words = max(1, int(target / 2.0))\n",
         "    words = max(1, int(target * 100 / count_prompt_tokens(a, model, random_words(100, rng))))\n"),
        ('                if ch.get("text"):\n', '                if ch.get("text") is not None:\n'),
    ],
}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    kit, dest = Path(argv[0]), Path(argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("bench_client.py", "load_client.py"):
        text = (kit / name).read_text()
        for old, new in FIXES.get(name, []):
            if text.count(old) != 1:
                print(f"{kit / name}: expected the line {old.strip()!r} once, found it {text.count(old)} times",
                      file=sys.stderr)
                return 1
            text = text.replace(old, new)
        (dest / name).write_text(text)
    shutil.copymode(kit / "bench_client.py", dest / "bench_client.py")
    print(f"peer clients with the fixes in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
