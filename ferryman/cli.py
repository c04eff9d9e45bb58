"""`ferryman` command line: run, info, plan, serve, ctl, bench serve, bench bw."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from ferryman.cli_bench import (
    HelpFormatter,
    Parser,
    RawHelpFormatter,
    add_bench,
    calibrated_rates,
    cmd_bench,
    existing_file,
    size,
    strategy,
)
from ferryman.cli_ctl import add_ctl, cmd_ctl
from ferryman.cli_serve import add_serve, cmd_serve
from ferryman.config import DECODE_MISSES, KV_CACHE_DTYPES, LOAD_FORMATS, PREFILL_MODES, EngineConfig, ModelConfig
from ferryman.envs import envs
from ferryman.errors import ConfigError, FerrymanError

DESCRIPTION = """\
ferryman runs Mixture-of-Experts language models on the machine you have.
With no MODEL argument, commands use the small demo model bundled with ferryman.
A MODEL is a Hugging Face model folder (config.json + *.safetensors + tokenizer files),
a GGUF file (the first part of a split set; or a folder holding one GGUF model),
or, with --load-format dummy, a built-in preset with random weights
(`ferryman info PRESET`; an unknown name lists them).
docs/configuration.md describes every setting."""
MODEL_HELP = "model folder, GGUF file or preset (default: the demo model)"
CONFIG_FOLDER_HELP = ("GGUF models: a Hugging Face model folder whose config.json and tokenizer files replace "
                      "the file's metadata (default: config, tokenizer and chat template from the GGUF file)")


def _quantization_flag(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    from ferryman.quant.hf_quant import QUANTIZATIONS

    g.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="format of dummy weights (--load-format dummy): fp8 (128x128 blocks), nvfp4, ...; a "
                        "checkpoint's own quantization_config is used as it is")


def _plan_flags(g: argparse._ArgumentGroup, max_num_seqs: int | None = None) -> None:
    """The flags `ferryman plan` shares with the engine commands (they size the memory plan)."""
    g.add_argument("--dtype", default="auto", help="compute dtype: auto (the checkpoint's), float32, bfloat16, float16")
    _quantization_flag(g)
    g.add_argument("--config-folder", metavar="DIR", help=CONFIG_FOLDER_HELP)
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's, at most 32768)")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help="sequences decoded together" if max_num_seqs else
                        "sequences decoded together (default: 32, or under --gpu-memory the largest of "
                        "32/16/8/4/2/1 whose KV floor leaves the experts half the free budget)")
    g.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per step, the prefill chunk; a prompt's last piece may take 1/32 more, so that no "
                        "step computes a tail of a few tokens (default: 2048, or 4096 when experts are offloaded)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: the model's dtype, or fp8 (e4m3: half the bytes, so more context or "
                        "more expert slots in the same budget; CUDA needs compute capability >= 8.9). "
                        "docs/benchmarks.md compares them")
    g.add_argument("--gpu-memory", metavar="SIZE", type=size,
                   help="cap on everything ferryman allocates on the GPU, e.g. 16GiB (default: the free memory "
                        "less 10%% of the total; see `ferryman plan`)")
    g.add_argument("--moe-strategy", default="auto", type=strategy, metavar="STRATEGY",
                   help="where routed experts live and compute: resident (all on the device), offload (host RAM, "
                        "a device cache, misses over the link), hybrid (misses split between the link and the "
                        "CPU by measured rates), cpu (every expert on the CPU), layers[:N] (the first N MoE "
                        "layers on the CPU, the rest resident; N fills the budget when not given), auto "
                        "(resident if they fit, else hybrid when the rates say it pays, else offload)")
    g.add_argument("--expert-cache", metavar="N",
                   help="device expert cache: a share of all experts (10%%, 0.1) or a slot count "
                        "(default: what the plan leaves)")
    g.add_argument("--min-expert-slots", type=int, metavar="N",
                   help="offloaded experts: slots the KV cache never takes back (default: two layers' experts, "
                        "at most the plan's slots)")
    g.add_argument("--kv-reserve-tokens", type=int, metavar="N",
                   help="offloaded experts: free KV tokens kept when idle KV pages become expert slots "
                        "(default: one step's tokens); `ferryman ctl` changes both live")
    g.add_argument("--prefill-mode", default="auto", choices=PREFILL_MODES,
                   help="prompts longer than a step: layer (each layer in all its chunks, each uncached expert "
                        "crosses the link once per prompt), chunk (each chunk through every layer); auto: layer "
                        "when experts are offloaded and the prompt's hidden states fit")
    g.add_argument("--decode-misses", default="auto", choices=DECODE_MISSES,
                   help="offloaded decode steps copy uncached experts into slots layer by layer (copy), or run as "
                        "one CUDA graph whose kernel reads them from pinned host memory (link); auto: link where "
                        "the experts' format reads well over the link and the strategy is auto or offload, kept only "
                        "while decode steps show it faster than copies (default: %(default)s)")


def _engine_flags(p: argparse.ArgumentParser, max_num_seqs: int | None = None) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (CUDA when present)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights of the exact shapes (no files needed); auto reads safetensors "
                        "or GGUF, whichever MODEL is")
    _plan_flags(g, max_num_seqs)
    g.add_argument("--enforce-eager", action="store_true", help="run without CUDA graphs")
    g.add_argument("--seed-weights", dest="seed", type=int, default=0, help="seed of dummy weights")
    g.add_argument("--calibration", metavar="PATH", type=existing_file,
                   help="rates file of the hybrid split (default: the one `ferryman bench bw` writes for the model; "
                        "else a quick measurement at start)")
    g.add_argument("--no-decode-prefetch", dest="decode_prefetch", action="store_false",
                   help="offloaded experts: do not copy the next layer's guessed experts ahead in decode steps "
                        "(default: copy them)")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the parsed flags set (every flag's dest is its field's name)."""
    kw = {f.name: getattr(a, f.name) for f in fields(EngineConfig) if f.name != "model" and hasattr(a, f.name)}
    if a.command in ("run", "serve"):
        kw["progress"] = sys.stderr.isatty()
    return kw


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """`ferryman plan`'s EngineConfig (run hands `engine_kwargs` to LLM, serve to the server)."""
    from ferryman.llm import default_model

    return EngineConfig(model=a.model or default_model(), **engine_kwargs(a))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ferryman", description=DESCRIPTION, formatter_class=RawHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and DEBUG logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="generate text from a prompt, streamed to the terminal",
                         description="Generate a completion for PROMPT and stream it to stdout.",
                         formatter_class=HelpFormatter)
    run.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    run.add_argument("-p", "--prompt", default="def quicksort(xs):", help="the prompt text")
    run.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    run.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = all)")
    run.add_argument("--seed", dest="sampling_seed", metavar="SEED", type=int, help="sampling seed (default: random)")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--stats", action="store_true", help="print engine statistics after the answer")
    _engine_flags(run, max_num_seqs=1)  # one prompt: the KV floor of the plan is one sequence
    info = sub.add_parser("info", help="architecture, sizes and expert bytes of a model",
                          description="Print a model's architecture and sizes without loading its weights.",
                          formatter_class=HelpFormatter)
    info.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    _quantization_flag(info)
    info.add_argument("--config-folder", metavar="DIR", help=CONFIG_FOLDER_HELP)
    _add_plan(sub)
    add_serve(sub, MODEL_HELP, _engine_flags)
    add_bench(sub)
    add_ctl(sub, HelpFormatter)
    return parser


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="how a GPU memory budget splits between weights, KV cache and experts",
                          description="Print the memory plan for MODEL under --gpu-memory without loading weights; "
                                      "exit 2 if the budget cannot hold the floor (weights, KV floor, activations, "
                                      "a minimal expert cache), saying how much is missing.",
                          formatter_class=HelpFormatter)
    plan.add_argument("model", nargs="?", metavar="MODEL", help=MODEL_HELP)
    _plan_flags(plan.add_argument_group("engine"))
    g = plan.add_argument_group("prediction (offloaded plans: `ferryman bench serve`'s output tok/s and TTFT at 1, "
                                "4 and max-num-seqs users)")
    g.add_argument("--prompt-tokens", type=int, default=1024, help="prompt tokens of each request")
    g.add_argument("--output-tokens", type=int, default=128, help="output tokens of each request")
    g.add_argument("--calibration", metavar="PATH", type=existing_file,
                   help="rates file of `ferryman bench bw` (default: the one it writes for the model)")


def cmd_run(a: argparse.Namespace) -> int:
    from ferryman import LLM

    params = _sampling_params(a)  # before loading: a bad flag fails at once
    if not a.prompt and not a.chat:
        raise ConfigError("--prompt is empty: give the text to complete, e.g. -p 'def quicksort(xs):'")
    llm = LLM(a.model, **engine_kwargs(a))
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


def _sampling_params(a: argparse.Namespace) -> Any:
    """SamplingParams of `ferryman run`'s flags; an invalid value is a ConfigError naming the flag."""
    from ferryman import SamplingParams

    try:
        return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.sampling_seed,
                              max_tokens=a.max_tokens)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")  # "max_tokens must be >= 1, got -5"
        raise ConfigError(f"--{field.replace('_', '-')} {rest}") from None


def _run_prompt(llm: Any, a: argparse.Namespace) -> str | list[int]:
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


def _formats_text(c: ModelConfig) -> str:
    """The experts' format, or each format with its number of layers when layers differ."""
    if not c.expert_formats:
        return c.expert_format
    counts = Counter(c.expert_format_of(i) for i in c.moe_layers)
    return ", ".join(f"{f} ({n} layers)" for f, n in counts.most_common())


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def cmd_plan(a: argparse.Namespace) -> int:
    from ferryman.experts.placement import engine_plan
    from ferryman.plan_report import Load, describe_plan, describe_predictions, predict
    from ferryman.weights.build import resolve_dtype, resolve_model

    ecfg = engine_config(a)
    cfg = resolve_model(ecfg.model, "dummy", ecfg.config_folder, ecfg.quantization).cfg
    dtype = resolve_dtype(ecfg.dtype, cfg)
    plan = engine_plan(ecfg, cfg, dtype, ecfg.torch_device(), ecfg.context_len(cfg))
    print(describe_plan(plan))
    if plan.strategy == "offload":
        rates = calibrated_rates(cfg, dtype, ecfg.calibration)
        loads = [Load(n, a.prompt_tokens, a.output_tokens) for n in sorted({1, 4, plan.request.max_num_seqs})]
        print(describe_predictions([predict(plan, rates, load) for load in loads], loads[0]))
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from ferryman.models.summary import summarize
    from ferryman.weights.build import resolve_model

    from ferryman.llm import default_model

    resolved = resolve_model(a.model or default_model(), "dummy", a.config_folder, a.quantization)
    folder = resolved.gguf.path if resolved.gguf is not None else resolved.folder
    s = summarize(resolved.cfg)
    c = s.cfg
    gib = 2**30
    rows = [
        ("model", str(folder) if folder else f"{a.model} (preset)"),
        ("architecture", c.model_type),
        ("layers", f"{c.num_layers} ({len(c.moe_layers)} MoE" + (f", {len(c.dense_layers)} dense)" if c.dense_layers
                                                                else ")")),
        ("hidden size", str(c.hidden_size)),
        ("attention", _attention_text(c)),
        ("experts", f"{c.num_experts} per layer, top-{c.top_k}, FFN {c.moe_intermediate_size}, "
                    f"format {_formats_text(c)}"
                    + (f"; shared experts FFN {c.shared_intermediate_size} (resident)"
                       if c.shared_intermediate_size else "")),
        ("routing", _routing_text(c)),
        ("parameters", f"{s.total_params / 1e9:.3f} B total, {s.active_params / 1e9:.3f} B active per token"),
        ("routed experts", f"{s.expert_bytes / gib:.2f} GiB ({s.bytes_per_expert / 2**20:.2f} MiB per expert)"),
        ("everything else", f"{s.other_bytes / gib:.2f} GiB"),
        ("context", str(c.max_position_embeddings) + _rope_scaling(c.rope)),
    ]
    if c.num_mtp_layers:
        last = c.num_layers + c.num_mtp_layers - 1
        span = str(c.num_layers) if c.num_mtp_layers == 1 else f"{c.num_layers}-{last}"
        rows.append(("not loaded", f"{c.num_mtp_layers} MTP layer(s): model.layers.{span}.* (multi-token prediction)"))
    for k, v in rows:
        print(f"{k:>16}: {v}")
    return 0


def _attention_text(c: ModelConfig) -> str:
    if c.mla is not None:  # what the KV cache holds per token and layer
        m = c.mla
        q = "q_proj" if m.q_lora_rank is None else f"q LoRA {m.q_lora_rank}"
        return (f"multi-head latent, {c.num_heads} heads ({q}, qk {m.qk_nope_head_dim}+{m.qk_rope_head_dim}, "
                f"v {m.v_head_dim}); cached per token: latent {m.kv_lora_rank} + rope {m.qk_rope_head_dim}")
    return (f"{c.num_heads} query / {c.num_kv_heads} kv heads, head_dim {c.head_dim}"
            + (f", sliding window {c.sliding_window}" if c.sliding_window else ""))


def _routing_text(c: ModelConfig) -> str:
    if c.router_kind != "sigmoid":
        return {"softmax_topk": "softmax, top-k", "topk_softmax": "top-k, softmax over k"}[c.router_kind] + (
            ", renormalised" if c.norm_topk_prob and c.router_kind == "softmax_topk" else "")
    groups = f", top-{c.topk_group} of {c.n_group} groups" if c.n_group > 1 else ""
    renorm = ", renormalised" if c.norm_topk_prob else ""
    return f"sigmoid + correction bias{groups}{renorm}, x{c.routed_scaling_factor:g}"


def _rope_scaling(rope: Any) -> str:
    """' (RoPE yarn x16 over 2048)' for a context stretched by RoPE scaling, else ''."""
    return f" (RoPE {rope.kind} x{rope.factor:g} over {rope.original_max_position})" if rope.factor != 1 else ""


def setup_logging(debug: bool = False) -> None:
    """The `ferryman` loggers to stderr at FERRYMAN_LOG_LEVEL, or DEBUG with --debug (the CLI's; a
    library user configures logging themselves)."""
    import logging

    class StderrHandler(logging.Handler):
        """Writes to whatever sys.stderr is when a record comes (redirections and captures apply)."""

        ferryman_cli = True

        def emit(self, record: logging.LogRecord) -> None:
            try:
                print(self.format(record), file=sys.stderr)
            except Exception:  # a bad format or a closed stderr must not break the engine
                self.handleError(record)

    logger = logging.getLogger("ferryman")
    if not any(getattr(h, "ferryman_cli", False) for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("[ferryman] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel("DEBUG" if debug else envs.LOG_LEVEL)


COMMANDS = {"run": cmd_run, "info": cmd_info, "plan": cmd_plan, "serve": lambda a: cmd_serve(a, engine_kwargs(a)),
            "bench": cmd_bench, "ctl": cmd_ctl}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None:
        parser.print_help()
        return 2
    debug = a.debug
    try:
        envs.reload()  # the environment is read once, here at start
        debug = debug or envs.LOG_LEVEL == "DEBUG"
        setup_logging(debug)
        return COMMANDS[a.command](a)
    except FerrymanError as e:
        if debug:
            raise
        print(f"ferryman: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
