"""`ferryman bench serve` (load test of any OpenAI-compatible server) and `ferryman bench bw` (the
rates the hybrid split uses): their parsers and commands, for ferryman/cli.py; and the rates
`ferryman plan`'s predictions read from a calibration (`calibrated_rates`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ferryman.config import parse_bytes, parse_strategy
from ferryman.errors import ConfigError, FerrymanError

if TYPE_CHECKING:  # annotations only: `ferryman --help` imports no torch
    import torch

    from ferryman.config import ModelConfig
    from ferryman.plan_report import Rates


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends '(default: X)' to a flag's help, unless the help says its default itself (None
    defaults, on/off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or action.default is None or isinstance(action.default, bool):
            return text
        return super()._get_help_string(action) or text


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter that keeps the description's own lines."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error, as every other CLI error is: 'ferryman run: error: argument
    --port: ...', exit status 2 (subcommands' parsers are of the same class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} --help`)\n")


def size(text: str) -> str:
    """A --gpu-memory style size: the text is kept (the config parses it), a bare number refused."""
    try:
        parse_bytes(text, name="")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def strategy(text: str) -> str:
    """A --moe-strategy value: one of config.STRATEGIES, or layers:N."""
    try:
        parse_strategy(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing_file(text: str) -> str:
    """A file the user names must be there (a missing one is not silently replaced by a default)."""
    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 1-65535 (0: any free port)")
    return value


def add_bench(sub: argparse._SubParsersAction) -> None:
    """`bench serve` and `bench bw` (the CLI's help formatters are defined here, below cli.py)."""
    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks.", formatter_class=HelpFormatter)
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)
    b = kinds.add_parser("serve", help="load-test an OpenAI-compatible server", formatter_class=HelpFormatter,
                         description="Concurrency sweep against URL/v1/completions (streaming): TTFT, "
                                     "inter-token latency and output tokens/s at p50 / p99.")
    b.add_argument("url", metavar="URL", help="server root, e.g. http://127.0.0.1:8000")
    b.add_argument("--model", help="model name (default: the first of /v1/models)")
    b.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    b.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each request")
    b.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request")
    b.add_argument("--requests-per-level", type=int,
                   help="requests per level (default: max(8, 2 x concurrency); 0: one per user, a single round)")
    b.add_argument("--api-key", help="sent as Authorization: Bearer KEY (default: none)")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON (default: not written)")
    b.add_argument("--plot", metavar="PATH", help="write a PNG plot, needs matplotlib (default: none)")
    _add_bench_bw(kinds)


BW_DESCRIPTION = """\
Measure, for MODEL's own experts (shape, format, dtype), the rates the hybrid split (--moe-strategy hybrid, auto) uses:
  (a) host memory read bandwidth
  (b) copies of one expert: pinned host -> device (with CUDA), and host -> host
  (c) CPU expert compute on the hybrid's own path: 1 token x top-k experts, then 4 tokens per expert
  (d) with CUDA, the link and the CPU compute at the same time (they share host memory)
  (e) each CPU expert kernel (MXFP4, bf16, fp16, fp32; GGUF q8_0 / q4_k / q6_k, int4, fp8, nvfp4 where
      MODEL's dims allow them) at 1, 8 and 32 tokens per expert, in GB/s
      and as a share of (a)
Each figure is the median of --reps repetitions. Writes a JSON file keyed by the expert geometry and
the machine; the engine reads it when the expert geometry, machine and thread count match (the
hybrid split, --moe-strategy auto|hybrid). --json prints every figure as one JSON object on stdout (--json PATH: into PATH).
No GPU is needed: without one the link is skipped."""


def _add_bench_bw(kinds: argparse._SubParsersAction) -> None:
    b = kinds.add_parser("bw", help="measure host, link and CPU expert rates (the hybrid split's) and each CPU kernel",
                         description=BW_DESCRIPTION, formatter_class=RawHelpFormatter)
    b.add_argument("model", nargs="?", metavar="MODEL", help="model folder or preset (default: the demo model)")
    b.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    b.add_argument("--quantization", default="none",
                   help="the experts' format for a preset measured as dummy weights (as `run --quantization`)")
    b.add_argument("--output", metavar="PATH",
                   help="calibration file (default: ~/.cache/ferryman/calibration-<fingerprint>.json)")
    b.add_argument("--reps", type=int, default=10, help="timed repetitions per figure (the median is kept)")
    b.add_argument("--read-mib", type=int, default=1024, help="buffer size of the host read measurement")
    b.add_argument("--pool-mib", type=int, default=256,
                   help="bytes of distinct experts cycled through, larger than the CPU caches")
    b.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="the figures as one JSON object, on stdout (the progress lines then go to stderr) or "
                        "into PATH (default: not written)")


def cmd_bench_bw(a: argparse.Namespace) -> int:
    import json
    import sys

    from ferryman.calibrate.bandwidth import MiB, run_bench
    from ferryman.calibrate.kernels import kernel_rates
    from ferryman.quant import cpu_kernel
    from ferryman.calibrate.calibration import default_path, expert_key
    from ferryman.engine.model_runner import expert_activation
    from ferryman.experts.hybrid import MIN_CPU_SHARE, rates, split_fetch
    from ferryman.llm import default_model
    from ferryman.weights.build import resolve_dtype, resolve_model

    if a.reps < 1 or a.read_mib < 1 or a.pool_mib < 1:
        raise ConfigError("--reps, --read-mib and --pool-mib must be >= 1")
    cfg = resolve_model(a.model or default_model(), "dummy", quantization=a.quantization).cfg
    if cfg.num_experts == 0:
        raise ConfigError("this model has no routed experts: nothing to measure")
    dtype = resolve_dtype(a.dtype, cfg)
    path = Path(a.output) if a.output else default_path(expert_key(cfg, dtype))
    out = sys.stderr if a.json == "-" else sys.stdout

    def log(line: str) -> None:
        print(line, file=out, flush=True)

    act = expert_activation(cfg)
    cal = run_bench(cfg, dtype, act, path, a.reps, a.read_mib * MiB, a.pool_mib * MiB, log=log)
    r_link, r_cpu, which = rates(cal, cal.h2d is not None)
    link = "link" if cal.h2d is not None else "host copy (no CUDA)"
    auto = ("try splitting misses with the CPU (kept where decode steps run faster)"
            if r_cpu >= MIN_CPU_SHARE * r_link else "not use the CPU")
    log(f"split: {link} {r_link:,.0f} experts/s, CPU {r_cpu:,.0f} experts/s ({which}); of 8 misses fetch "
        f"{split_fetch(8, r_link, r_cpu)}; --moe-strategy auto would {auto}")
    log(f"(e) CPU expert kernels ({cpu_kernel.isa_name()}, {cpu_kernel.threads()} threads), top-{cfg.top_k} "
        f"experts per job ...")
    kernels = kernel_rates(cfg, act, cal.host_read_gbps or 0.0, a.reps, a.pool_mib * MiB)
    for row in kernels:
        log(f"    {row['kernel']:5s} {row['tokens']:2d} tokens: {row['experts_per_s']:8,.0f} experts/s, "
            f"{row['gbps']:6.1f} GB/s ({row['of_host_read']:.2f} of host read)")
    if a.json:
        text = json.dumps({"calibration": cal.to_json(), "path": str(path), "host_read_gbps": cal.host_read_gbps,
                           "cpu_kernel": {"isa": cpu_kernel.isa_name(), "threads": cpu_kernel.threads()},
                           "cpu_kernels": kernels}, indent=2)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text + "\n")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if a.bench_command == "bw":
        return cmd_bench_bw(a)
    if not a.url.startswith(("http://", "https://")):
        raise ConfigError(f"URL must start with http:// or https://, got {a.url!r}")
    import json

    from ferryman.server.bench import BenchConfig, plot, run_bench

    try:
        levels = tuple(int(x) for x in a.concurrency.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--concurrency must be comma-separated integers, got {a.concurrency!r}") from None
    if not levels or min(levels) < 1 or a.prompt_tokens < 1 or a.output_tokens < 1:
        raise ConfigError("--concurrency levels, --prompt-tokens and --output-tokens must be >= 1")
    if a.requests_per_level is not None and a.requests_per_level < 0:
        raise ConfigError(f"--requests-per-level must be >= 0 (0: one per user), got {a.requests_per_level}")
    cfg = BenchConfig(url=a.url, model=a.model, levels=levels, prompt_tokens=a.prompt_tokens,
                      output_tokens=a.output_tokens, requests_per_level=a.requests_per_level, api_key=a.api_key)
    try:
        result = run_bench(cfg, log=print)
    except OSError as e:
        raise FerrymanError(f"cannot reach {a.url}: {e}") from None
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    if a.plot:
        plot(result, Path(a.plot))
    return 0


def calibrated_rates(cfg: ModelConfig, dtype: torch.dtype, path: str | None = None,
                     link: tuple[float, str] | None = None) -> Rates:
    """The predictions' rates (plan_report.Rates): the link (`link` as given, e.g. measured by a
    server, else this machine's calibration, else the assumed PCIe 5.0 rate) and the device's compute
    (the calibration's, `ferryman bench bw` on a CUDA machine, else assumed), each with its source."""
    from ferryman.calibrate.calibration import expert_key, load_matching
    from ferryman.plan_report import ASSUMED_LINK, FLOPS, Rates

    cal, why = load_matching(expert_key(cfg, dtype), Path(path) if path else None)
    if link is None and cal is not None and cal.h2d is not None:
        link = (cal.h2d.gbps * 1e9, "calibrated")
    link = link or (ASSUMED_LINK[1], f"assumed {ASSUMED_LINK[0]}: {why if cal is None else 'no host -> device rate'}")
    device = cal.device if cal is not None else None
    if device is not None and device.experts == cfg.num_experts:
        return Rates(*link, device.moe_seconds, device.matmul_flops, "calibrated")
    lacking = ("no calibration" if cal is None else "the calibration has no device compute: `ferryman bench bw` on a GPU"
               if device is None else f"the calibration's device figures are for {device.experts} experts a layer")
    return Rates(*link, compute_source=f"assumed {FLOPS / 1e12:.0f} TFLOP/s ({lacking})")
