"""`ferryman ctl`: watch and steer a running server's memory split (server/admin_api.py).

    ferryman ctl [show] [--url URL] [--json]      KV pages vs expert slots, hit rate, link, preemptions
    ferryman ctl set --min-expert-slots N --max-expert-slots N --kv-reserve-tokens N

The API key comes from --api-key or FERRYMAN_API_KEY, as for `ferryman serve`.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from ferryman.envs import envs
from ferryman.errors import ConfigError

MiB = 1 << 20


def add_ctl(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    ctl = sub.add_parser("ctl", help="show or set a running server's split of GPU memory (KV vs expert slots)",
                         description="Talk to a running `ferryman serve`: show how its device region splits "
                                     "between KV pages and expert slots, or set the split's bounds live.",
                         formatter_class=formatter)
    ctl.add_argument("action", nargs="?", choices=("show", "set"), default="show", help="what to do")
    ctl.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ctl.add_argument("--api-key", help="the server's API key (default: the environment's, as `ferryman serve` reads it)")
    ctl.add_argument("--json", action="store_true", help="print the server's JSON answer as is")
    ctl.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server")
    for flag, what in (("--min-expert-slots", "expert slots the KV cache never takes back"),
                       ("--max-expert-slots", "expert slots the cache never grows beyond"),
                       ("--kv-reserve-tokens", "free KV tokens kept when idle KV pages become slots")):
        ctl.add_argument(flag, type=int, metavar="N", help=f"set: {what} (default: left as the server has it)")


def cmd_ctl(a: argparse.Namespace) -> int:
    bounds = {k: getattr(a, k) for k in ("min_expert_slots", "max_expert_slots", "kv_reserve_tokens")
              if getattr(a, k) is not None}
    if a.action == "set" and not bounds:
        raise ConfigError("ferryman ctl set: give at least one of --min-expert-slots, --max-expert-slots, "
                          "--kv-reserve-tokens")
    if a.action == "show" and bounds:
        raise ConfigError("ferryman ctl: bounds are set with `ferryman ctl set ...`")
    split = _call(a, bounds if a.action == "set" else None)
    print(json.dumps(split, indent=2) if a.json else describe_split(split))
    return 0


def _call(a: argparse.Namespace, body: dict[str, int] | None) -> dict[str, Any]:
    url = a.url.rstrip("/") + "/v1/admin/memory"
    key = a.api_key or envs.API_KEY
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=a.timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{url}: HTTP {e.code}: {_message(e.read())}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"{url}: cannot reach the server ({getattr(e, 'reason', e)})") from None


def _message(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return err["message"] if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


def describe_split(s: dict[str, Any]) -> str:
    if not s.get("shared"):
        return (f"no shared region (every expert resident): KV and experts are fixed; "
                f"preemptions {s.get('num_preemptions', 0)}")
    return "\n".join(f"{k:>12}: {v}" for k, v in [*_split_rows(s), ("miss path", describe_miss_path(s))])


def describe_miss_path(s: dict[str, Any]) -> str:
    """How decode steps reach uncached experts: link reads (auto's on trial, or kept after it), or
    copies layer by layer (after a trial against link reads, or chosen)."""
    trial = s.get("link_trial") or {}
    mode = s.get("miss_path")
    if mode == "link":
        how = "read over the link by the decode kernel, whole steps in one CUDA graph"
        if trial and trial.get("verdict") is None:
            return f"{how} (auto's choice on trial against copies: {trial.get('steps', 0)} steps so far)"
        return how + (f" ({trial['reason']})" if trial.get("reason") else "")
    if mode in ("layer", "off"):
        how = "copied into slots layer by layer" + (" (decode without CUDA graphs)" if mode == "off" else "")
        return how + (f" (auto: {trial['reason']})" if trial.get("reason") else "")
    return "none: every expert resident" if mode == "none" else str(mode)


def _split_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    page, q, bs = s["page_bytes"], s["blocks_per_page"], s["block_size"]
    kv_tokens = s["kv_pages"] * q * bs
    return [
        ("region", f"{s['pages']} pages of {page / MiB:.1f} MiB ({s['region_bytes'] / 2**30:.2f} GiB); "
                   f"a page = 1 expert slot or {q} KV blocks of {bs} tokens"),
        ("kv cache", f"{s['kv_pages']} pages = {kv_tokens} tokens; blocks {s['kv_blocks_used']} in use, "
                     f"{s['kv_blocks_free']} free (floor {s['min_kv_pages']} pages)"),
        ("experts", f"{s['expert_pages']} slots, {s['expert_slots_filled']} filled; bounds "
                    f"[{s['min_expert_slots']}, {s['max_expert_slots']}]"),
        ("kv reserve", f"{s['kv_reserve_blocks'] * bs} tokens kept free before pages become slots"),
        ("moves", f"{s['moves_to_kv']} pages to KV, {s['moves_to_experts']} to experts"),
        ("hit rate", f"{s['hit_rate']:.1%}"),
        ("link", f"{s['link_gbps']:.1f} GB/s while copying"),
        ("preemptions", str(s["num_preemptions"])),
    ]
