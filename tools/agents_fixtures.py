"""Turn tools/agents_proxy.py logs into replay fixtures (tests/fixtures/agents/<agent>/NN.json).

    python tools/agents_fixtures.py LOG_DIR tests/fixtures/agents/opencode --agent "opencode 1.18.33" \
        --replace /tmp/capture/work=/home/user/project --replace /tmp/capture/home=/home/user

Keeps the model requests (POST to /v1/...), drops retries of an identical body, the HEAD probes
and the headers that only describe one connection. Scrubs what identifies a person or a machine:
paths given with --replace, UUIDs and session ids (replaced by zero ids of the same shape), hex
device ids, and the kernel's version string. The shapes stay: tools, system prompts, betas.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding", "x-stainless-retry-count",
                   "x-stainless-timeout", "x-stainless-runtime-version"}
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
DEVICE_ID = re.compile(r"\b[0-9a-f]{64}\b")
SESSION_ID = re.compile(r"\bses_[A-Za-z0-9]{20,}\b")
KERNEL = re.compile(r"Linux \d+\.\d+\.\d+[-\w.]*")


def scrub_text(text: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        text = text.replace(old, new)
    text = UUID.sub("00000000-0000-0000-0000-000000000000", text)
    text = DEVICE_ID.sub("0" * 64, text)
    text = SESSION_ID.sub("ses_" + "0" * 26, text)
    return KERNEL.sub("Linux 6.0.0", text)


def scrub(value: Any, replacements: list[tuple[str, str]]) -> Any:
    """Every string inside a JSON value scrubbed (dict keys too)."""
    if isinstance(value, str):
        return scrub_text(value, replacements)
    if isinstance(value, list):
        return [scrub(v, replacements) for v in value]
    if isinstance(value, dict):
        return {scrub_text(k, replacements): scrub(v, replacements) for k, v in value.items()}
    return value


def fixture(record: dict[str, Any], agent: str, replacements: list[tuple[str, str]]) -> dict[str, Any]:
    headers = {k: v for k, v in record["headers"].items() if k not in DROPPED_HEADERS}
    return scrub({"agent": agent, "method": record["method"], "path": record["path"], "headers": headers,
                  "body": record["body"]}, replacements)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", type=Path, help="folder of NN.json files written by agents_proxy.py")
    p.add_argument("out", type=Path, help="fixture folder of one agent")
    p.add_argument("--agent", required=True, help="the agent and its version, e.g. 'codex-cli 0.171.0'")
    p.add_argument("--replace", action="append", default=[], metavar="OLD=NEW", help="a path to scrub (repeatable)")
    p.add_argument("--max", type=int, default=4, help="keep at most this many requests")
    args = p.parse_args(argv)
    replacements = sorted((tuple(r.split("=", 1)) for r in args.replace), key=lambda r: -len(r[0]))
    args.out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for path in sorted(args.logs.glob("[0-9][0-9].json")):
        record = json.loads(path.read_text())
        key = json.dumps(record["body"], sort_keys=True)
        if record["method"] != "POST" or not record["path"].startswith("/v1/") or key in seen:
            continue  # probes and retries
        seen.add(key)
        out = args.out / f"{len(seen):02d}.json"
        out.write_text(json.dumps(fixture(record, args.agent, replacements), indent=1, ensure_ascii=False) + "\n")
        print(f"{path} -> {out}")
        if len(seen) == args.max:
            break


if __name__ == "__main__":
    main()
