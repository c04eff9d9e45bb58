"""`ferryman` command line: run, info, serve, bench serve, bench bw."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ferryman.cli_bench import add_bench, cmd_bench
from ferryman.errors import FerrymanError

DESCRIPTION = """\
ferryman runs Mixture-of-Experts language models on the machine you have.
With no MODEL argument, commands use the small demo model bundled with ferryman.
A MODEL is a Hugging Face model folder (config.json + *.safetensors + tokenizer files),
or, with --load-format dummy, a built-in preset with random weights
(gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b, mixtral-8x7b, olmoe-1b-7b)."""


def _plan_flags(g: argparse._ArgumentGroup) -> None:
    """The flags `ferryman plan` shares with the engine commands (they size the memory plan)."""
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: model's, capped at 32768)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences decoded together (default: 32, or under --gpu-memory the largest of "
                        "32/16/8/4/2/1 whose KV floor leaves the experts half the free budget)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, the prefill chunk size (default: 2048, or 4096 when experts are offloaded)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache storage: auto (the model's dtype) or fp8 (e4m3, half the bytes: more context "
                        "or more expert slots in the same budget, e.g. gpt-oss-20b at 8 GiB with 16 users: 306 -> "
                        "337 slots; measured 105.8 -> 115.5 tok/s on an H200 before the sliding-window KV pool "
                        "(277 -> 322 slots then); needs compute capability >= 8.9 on CUDA)")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy = random weights of the exact shapes (no files needed)")
    _plan_flags(g)
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--seed-weights", type=int, default=0, help="seed of dummy weights")
    _expert_flags(g)
    g.add_argument("--cpu-experts", default="off", choices=["off", "auto", "on"],
                   help="offload: compute some missing experts on the CPU while others are fetched, split by "
                        "rates measured on this machine (`ferryman bench bw`, else a quick measurement at start) "
                        "and followed as jobs finish. auto: on a GPU, when the CPU reaches 1/4 of the link's rate; "
                        "off on a CPU-only machine. Default off: on an H200, gpt-oss-20b at 8 GiB decoded 16 "
                        "sequences 20%% faster with auto, but 16 served users got no more tokens/s and a later TTFT")
    g.add_argument("--calibration", default=None, metavar="PATH",
                   help="rates file for --cpu-experts (default: the one `ferryman bench bw` writes for the model)")


def _expert_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--gpu-memory", default=None, metavar="SIZE",
                   help="cap on everything ferryman allocates on the GPU, e.g. 16GiB (see `ferryman plan`)")
    g.add_argument("--moe-strategy", default="auto", choices=["auto", "resident", "offload"],
                   help="experts all on the device, or in host RAM with a device cache (auto: resident if they fit)")
    g.add_argument("--expert-cache", default=None, metavar="N",
                   help="device expert cache: a share of all experts (10%%, 0.1) or a slot count (default: the plan's rest)")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(device=a.device, dtype=a.dtype, load_format=a.load_format, max_model_len=a.max_model_len,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                enforce_eager=a.enforce_eager, seed=a.seed_weights, progress=sys.stderr.isatty(),
                gpu_memory=a.gpu_memory, moe_strategy=a.moe_strategy, expert_cache=a.expert_cache,
                cpu_experts=a.cpu_experts, calibration=a.calibration, kv_cache_dtype=a.kv_cache_dtype)


def _env_help() -> str:
    """The environment variables ferryman reads, with any set value, for the top-level --help."""
    from ferryman.envs import describe

    return describe()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferryman", description=DESCRIPTION, epilog=_env_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="generate text from a prompt, streamed to the terminal",
                         description="Generate a completion for PROMPT and stream it to stdout.")
    run.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model folder or preset (default: demo model)")
    run.add_argument("-p", "--prompt", default="def quicksort(xs):", help="the prompt text")
    run.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    run.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = all)")
    run.add_argument("--seed", type=int, default=None, help="sampling seed")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--stats", action="store_true", help="print engine statistics after the answer")
    _engine_flags(run)
    # one prompt: the KV floor of the memory plan is one sequence, not a server's worth
    run.set_defaults(max_num_seqs=1)

    info = sub.add_parser("info", help="architecture, sizes and expert bytes of a model",
                          description="Print a model's architecture and sizes without loading its weights.")
    info.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model folder or preset (default: demo model)")
    _add_plan(sub)
    _add_serve(sub)
    add_bench(sub)
    return parser


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server",
                           description="Serve MODEL over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                                       "/v1/messages, /health, /metrics, /v1/stats.")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model folder or preset (default: demo model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key)")
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="name clients use for the model (repeatable; default: the folder name)")
    serve.add_argument("--max-queue", type=int, default=256, help="requests in flight before answering 429")
    serve.add_argument("--max-body-mb", type=float, default=8.0, help="larger request bodies get 413")
    serve.add_argument("--output-parser", default="auto", choices=["auto", "qwen3", "harmony", "none"],
                       help="reasoning / tool-call parser (auto: harmony for gpt-oss, else qwen3)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                       help="serve at once, without first running a batch of requests that compiles the GPU "
                            "kernels (the first users then pay for the compiles: up to seconds of TTFT; "
                            "on a CPU there is no warm-up either way)")
    _engine_flags(serve)


def cmd_run(a: argparse.Namespace) -> int:
    from ferryman import LLM, SamplingParams

    llm = LLM(a.model, **_engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                            max_tokens=a.max_tokens)
    prompt = _run_prompt(llm, a)
    for delta in llm.stream(prompt, params):
        # without a tokenizer (dummy presets, bare checkpoints) the output is shown as token ids
        sys.stdout.write(delta.text if llm.tokenizer is not None else "".join(f" {t}" for t in delta.token_ids))
        sys.stdout.flush()
    sys.stdout.write("\n")
    out = llm.last_output
    if out is not None:
        m = out.metrics
        tps = f"{m.decode_tokens_per_s:.1f}" if m.decode_tokens_per_s else "-"
        ttft = f"{m.ttft_s:.3f}" if m.ttft_s is not None else "-"
        print(f"[{m.num_output_tokens} tokens, finish={out.finish_reason}, ttft {ttft} s, decode {tps} tok/s]",
              file=sys.stderr)
    if a.stats:
        _print_stats(llm.stats())
    return 0


def _run_prompt(llm, a: argparse.Namespace) -> str | list[int]:
    """The prompt as `LLM.stream` takes it; echoes it to stdout."""
    if llm.tokenizer is None:
        if a.chat:
            raise FerrymanError("--chat needs a tokenizer with a chat template; this model has no tokenizer files")
        ids = [b % llm.engine.cfg.vocab_size for b in a.prompt.encode("utf-8")]
        print("[no tokenizer: the prompt is sent as its UTF-8 byte values, the output shown as token ids]",
              file=sys.stderr)
        sys.stdout.write(" ".join(map(str, ids)) + " |")
        return ids
    if a.chat:
        return llm.chat_ids([{"role": "user", "content": a.prompt}])
    sys.stdout.write(a.prompt)
    return a.prompt


def _print_stats(stats: dict, indent: str = "  ") -> None:
    """One line per value; nested dicts (stats["experts"]) indented below their key."""
    for k, v in stats.items():
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            print(f"{indent}{k}:", file=sys.stderr)
            for sub, row in v.items():
                print(f"{indent}  {sub}: " + ", ".join(f"{c}: {_fmt(x)}" for c, x in row.items()), file=sys.stderr)
        elif isinstance(v, dict) and v and not all(isinstance(x, (int, float)) for x in v.values()):
            print(f"{indent}{k}:", file=sys.stderr)
            _print_stats(v, indent + "  ")
        elif isinstance(v, dict):
            print(f"{indent}{k}: " + ", ".join(f"{s}: {_fmt(x)}" for s, x in v.items()), file=sys.stderr)
        else:
            print(f"{indent}{k}: {_fmt(v)}", file=sys.stderr)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="how a GPU memory budget splits between weights, KV cache and experts",
                          description="Print the memory plan for MODEL under --gpu-memory without loading weights; "
                                      "exit 2 if the budget cannot hold the floor (weights, KV floor, activations, "
                                      "a minimal expert cache), saying how much is missing.")
    plan.add_argument("model", nargs="?", default=None, metavar="MODEL", help="model folder or preset (default: demo model)")
    g = plan.add_argument_group("engine")
    _plan_flags(g)
    _expert_flags(g)


def cmd_plan(a: argparse.Namespace) -> int:
    from ferryman.config import EngineConfig, ModelConfig
    from ferryman.experts.placement import engine_plan
    from ferryman.llm import default_model
    from ferryman.weights.build import resolve_dtype, resolve_hf_config

    model = a.model or default_model()
    ecfg = EngineConfig(model=model, device="auto", dtype=a.dtype, max_model_len=a.max_model_len,
                        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                        gpu_memory=a.gpu_memory, moe_strategy=a.moe_strategy, expert_cache=a.expert_cache,
                        kv_cache_dtype=a.kv_cache_dtype)
    cfg = ModelConfig.from_hf(resolve_hf_config(model, "dummy")[0])
    ctx = cfg.max_position_embeddings
    max_len = min(ctx, 32768) if a.max_model_len is None else a.max_model_len
    if max_len > ctx:
        raise FerrymanError(f"max_model_len {max_len} exceeds the model's context ({ctx})")
    print(engine_plan(ecfg, cfg, resolve_dtype(a.dtype, cfg), ecfg.torch_device(), max_len).describe())
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from ferryman.llm import default_model
    from ferryman.models.summary import summarize
    from ferryman.weights.build import resolve_hf_config

    hf, folder = resolve_hf_config(a.model or default_model(), "dummy")
    s = summarize(hf)
    c = s.cfg
    gib = 2**30
    rows = [
        ("model", str(folder) if folder else f"{a.model} (preset)"),
        ("architecture", c.model_type),
        ("layers", f"{c.num_layers} ({len(c.moe_layers)} MoE)"),
        ("hidden size", str(c.hidden_size)),
        ("attention", f"{c.num_heads} query / {c.num_kv_heads} kv heads, head_dim {c.head_dim}"
                      + (f", sliding window {c.sliding_window}" if c.sliding_window else "")),
        ("experts", f"{c.num_experts} per layer, top-{c.top_k}, FFN {c.moe_intermediate_size}, format {c.expert_format}"),
        ("parameters", f"{s.total_params / 1e9:.3f} B total, {s.active_params / 1e9:.3f} B active per token"),
        ("routed experts", f"{s.expert_bytes / gib:.2f} GiB ({s.bytes_per_expert / 2**20:.2f} MiB per expert)"),
        ("everything else", f"{s.other_bytes / gib:.2f} GiB"),
        ("context", str(c.max_position_embeddings)),
    ]
    for k, v in rows:
        print(f"{k:>16}: {v}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from ferryman.server import ServerConfig, serve
    except ImportError as e:
        raise FerrymanError(f"ferryman serve needs the serve extra (pip install 'ferryman[serve]'): {e}") from None
    cfg = ServerConfig(served_model_names=a.served_model_name or [], api_key=a.api_key,
                       max_body_bytes=int(a.max_body_mb * 2**20), max_pending=a.max_queue,
                       output_parser=a.output_parser, warm_up=a.warm_up)
    serve(_engine_kwargs(a), a.model, cfg, host=a.host, port=a.port, log_level=a.log_level)
    return 0


def setup_logging(debug: bool = False) -> None:
    """The `ferryman` loggers to stderr at FERRYMAN_LOG_LEVEL, or DEBUG with --debug (the CLI's; a
    library user configures logging themselves)."""
    import logging

    from ferryman.envs import envs

    class StderrHandler(logging.StreamHandler):
        """Writes to whatever sys.stderr is when a record comes (redirections and captures apply)."""

        ferryman_cli = True

        @property  # type: ignore[override]
        def stream(self) -> Any:
            return sys.stderr

        @stream.setter
        def stream(self, _value: Any) -> None:
            pass

    logger = logging.getLogger("ferryman")
    if not any(getattr(h, "ferryman_cli", False) for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("[ferryman] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel("DEBUG" if debug else envs.LOG_LEVEL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None:
        parser.print_help()
        return 2
    from ferryman.envs import envs

    debug = a.debug or envs.DEBUG
    try:
        setup_logging(debug)
        if a.command == "plan":
            return cmd_plan(a)
        return {"run": cmd_run, "info": cmd_info, "serve": cmd_serve, "bench": cmd_bench}[a.command](a)
    except FerrymanError as e:
        if debug:
            raise
        print(f"ferryman: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
