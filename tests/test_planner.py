"""Memory planner: sizes against transformers' own module tree, the budget split, refusals with the
amount missing, `ferryman plan`, and a budget driving the engine with the CPU as the device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.cli import main
from ferryman.config import GiB, ModelConfig, parse_bytes, parse_expert_cache
from ferryman.errors import ConfigError
from ferryman.llm import DEMO_MODEL
from ferryman.models.registry import get_architecture, model_config
from ferryman.plan_report import describe_plan
from ferryman.kvcache.shared_region import PageGeometry
from ferryman.planner import (
    PlanRequest,
    activation_bytes,
    host_embedding_bytes,
    kv_bytes_per_token,
    non_expert_bytes,
    non_expert_params,
    prefill_job_bytes,
    slot_bytes,
)
from ferryman.planner_search import plan_auto_seqs, plan_memory
from ferryman.weights.presets import get_preset


def _cfg(name: str) -> ModelConfig:
    return model_config(dict(get_preset(name)))


def _req(name: str, budget: str | None, **kw: object) -> PlanRequest:
    args = dict(max_model_len=32768, max_num_seqs=1)
    args.update(kw)
    return PlanRequest(_cfg(name), torch.bfloat16, None if budget is None else parse_bytes(budget), **args)


@pytest.mark.parametrize("text,want", [("16GiB", 16 * GiB), ("16G", 16 * GiB), ("16 gb", 16 * 10**9),
                                       ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), ("4096B", 4096),
                                       (GiB, GiB)])
def test_parse_bytes(text: str | int, want: int) -> None:
    assert parse_bytes(text) == want


@pytest.mark.parametrize("bad", ["16 apples", "", "-1GiB", "0", "16", 16, 16.0, True])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="gpu_memory"):
        parse_bytes(bad)


@pytest.mark.parametrize("text,want", [("10%", 0.1), ("0.25", 0.25), (0.5, 0.5), ("64", 64), (64, 64), (1.0, 1.0)])
def test_parse_expert_cache(text: object, want: float | int) -> None:
    got = parse_expert_cache(text)
    assert got == pytest.approx(want) and type(got) is type(want)


@pytest.mark.parametrize("bad", ["ten", "0%", 0, -3, 1.5, "150%", True])
def test_parse_expert_cache_rejects(bad: object) -> None:
    with pytest.raises(ConfigError, match="expert_cache"):
        parse_expert_cache(bad)


def _hf_module_sizes(name: str) -> tuple[int, int, int]:
    """(non-expert, routed-expert weight, routed-expert bias) parameters of transformers' own model,
    built on the meta device."""
    transformers = pytest.importorskip("transformers")
    hf = dict(get_preset(name))
    hf.pop("quantization_config", None)
    cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    bias = sum(p.numel() for n, p in params.items() if ".experts." in n and n.endswith("bias"))
    return sum(p.numel() for p in params.values()) - experts, experts - bias, bias


@pytest.mark.parametrize("name", ["gpt-oss-120b", "qwen3-30b-a3b"])
def test_weights_and_kv_sizes_match_transformers(name: str) -> None:
    other, experts, bias = _hf_module_sizes(name)
    cfg = _cfg(name)
    assert non_expert_bytes(cfg, torch.bfloat16) == 2 * other
    total = len(cfg.moe_layers) * cfg.num_experts
    bytes_per_weight = 0.5 + 1 / 32 if cfg.expert_format == "mxfp4" else 2  # e2m1 + one e8m0 per 32
    payload = (experts * bytes_per_weight + bias * 2) / total  # one routed expert, biases in bf16
    assert payload <= slot_bytes(cfg, torch.bfloat16) <= payload + 6 * 64  # banks aligned to 64 bytes
    assert kv_bytes_per_token(cfg, torch.bfloat16) == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def test_offload_plan_gives_experts_the_rest() -> None:
    req = _req("gpt-oss-120b", "16GiB")
    plan = plan_memory(req)
    cfg = req.cfg
    assert plan.strategy == "offload"
    # 18 full-attention layers hold the context; the 18 sliding ones (window 128) a pool of
    # 1 null + (8 + 2) + 9 retained + (4096 + 128) / 16 blocks of 16 tokens (kvcache/window_pool.py; a
    # step's chunk and the tail a prompt's last piece may take, prefill_steps.step_tokens)
    # KV and expert slots share one region of pages (a slot = 23 KV blocks): KV starts at its floor,
    # one sequence of max_model_len in whole pages
    kv_pages = plan.pages.pages_for_tokens(32768, 16)
    assert plan.pages.blocks_per_page == 23 and plan.pages.page_bytes >= plan.slot_bytes
    assert plan.kv_tokens == kv_pages * 23 * 16 >= 32768 and plan.request.window_blocks == 284
    assert plan.kv_bytes == kv_pages * plan.pages.page_bytes + 284 * 16 * 18 * 2048
    assert plan.request.max_num_batched_tokens == 4096  # offloaded: the longer default step
    # + the hidden states of a layer-major prefill of up to max_model_len tokens (planner_search.prefill_plan)
    assert plan.prefill_job_tokens == 32768
    assert plan.activation_bytes == activation_bytes(cfg, torch.bfloat16, 4096 + 128, 1) + \
        prefill_job_bytes(cfg, torch.bfloat16, 32768)
    assert plan.total_bytes <= req.budget < plan.total_bytes + plan.pages.page_bytes
    assert 0.10 < plan.expert_slots / req.total_experts < 0.20
    text = describe_plan(plan)
    assert "offload" in text and f"{plan.expert_slots} of {req.total_experts}" in text
    # the uniform-routing link bound: 36 layers x top-4 x the uncached share, one slot each
    misses = 36 * 4 * (1 - plan.expert_slots / req.total_experts)
    per_token = misses * plan.slot_bytes
    assert f"~{misses:.0f} misses" in text and f"PCIe 5.0 <= {55e9 / per_token:.0f} tok/s" in text
    assert "decode link" not in describe_plan(plan_memory(_req("gpt-oss-120b", "139GiB")))  # resident
    # the fp8 KV hint: half the bf16 cache, as whole slots; none once the cache is fp8
    freed = plan.kv_bytes // 2
    assert f"--kv-cache-dtype fp8 would free {freed / GiB:.2f} GiB of KV cache: {freed // plan.slot_bytes} more" in text
    fp8 = plan_memory(_req("gpt-oss-120b", "16GiB", kv_dtype=torch.float8_e4m3fn))
    assert "--kv-cache-dtype fp8 would" not in describe_plan(fp8)
    assert fp8.expert_slots >= plan.expert_slots + freed // plan.slot_bytes
    # offloaded: the token-embedding table (vocab x hidden) stays in host RAM and its bytes are slots
    table = cfg.vocab_size * cfg.hidden_size * 2
    assert plan.host_embedding_bytes == table == host_embedding_bytes(cfg, torch.bfloat16)
    assert plan.weights_bytes == non_expert_bytes(cfg, torch.bfloat16) - table
    assert "token embedding (1.08 GiB) in host RAM" in text
    assert plan_memory(_req("gpt-oss-120b", "139GiB")).host_embedding_bytes == 0  # resident: on the device


def test_host_embedding_is_kept_on_the_device_when_lm_head_shares_it() -> None:
    cfg = replace(_cfg("gpt-oss-20b"), tie_word_embeddings=True)
    assert host_embedding_bytes(cfg, torch.bfloat16) == 0


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b"])
def test_non_expert_params_match_the_checkpoint_schema(name: str) -> None:
    cfg = _cfg(name)
    arch = get_architecture(cfg.model_type)
    schema = arch.checkpoint_tensors(cfg)
    want = sum(torch.Size(shape).numel() for n, (shape, _) in schema.items()
               if (t := arch.map_name(cfg, n)) is not None and t.kind != "expert")
    assert non_expert_params(cfg) == want


# Every variable ferryman read before its settings moved into EngineConfig, set to odd values.
HOSTILE_ENV = {
    "FERRYMAN_MOE_BACKEND": "torch", "FERRYMAN_ATTN_BACKEND": "torch", "FERRYMAN_MOE_DECODE_TILES": "16,16,1,x",
    "FERRYMAN_DISABLE_CUDA_GRAPHS": "1", "FERRYMAN_SEGMENT_GRAPHS": "0", "FERRYMAN_PREFILL_LOOKAHEAD": "7",
    "FERRYMAN_HOST_EMBEDDING": "0", "FERRYMAN_WINDOW_KV": "0", "FERRYMAN_EXPANDABLE_SEGMENTS": "0",
    "FERRYMAN_PREFETCH_AFTER_KERNELS": "0", "FERRYMAN_PREFETCH_BEFORE_GROUPS": "0",
    "FERRYMAN_INPUTS_ON_COPY_STREAM": "all", "FERRYMAN_STREAM_EVEN": "0", "FERRYMAN_MOE_GRAPHS": "0",
    "FERRYMAN_DECODE_PREFETCH": "late2", "FERRYMAN_DECODE_PREFETCH_MAX_SEQS": "3", "FERRYMAN_DECODE_GAP_GUESS": "9",
    "FERRYMAN_PREFETCH_AVOID_BUSY": "0", "FERRYMAN_PREFETCH_SPLIT_BUSY": "1", "FERRYMAN_DECODE_WRAP_GUESS": "0",
    "FERRYMAN_DECODE_PREFETCH_TOPK": "11", "FERRYMAN_DECODE_PREFETCH_SOLO_TOPK": "5", "FERRYMAN_ZERO_COPY": "1",
    "FERRYMAN_ZERO_COPY_STAGE": "64", "FERRYMAN_CPU_THREADS": "3", "FERRYMAN_HYBRID_MIN_CPU": "9",
    "FERRYMAN_MOE_PREFILL": "reference", "FERRYMAN_MOE_PREFILL_GROUP": "3", "FERRYMAN_KERNELS": "torch",
}


def test_the_plan_is_a_function_of_its_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [_req("gpt-oss-20b", "8GiB"), _req("gpt-oss-120b", "16GiB", max_num_seqs=4),
                _req("gpt-oss-120b", "40GiB", expert_cache=0.1), _req("gpt-oss-20b", None)]
    clean = [plan_memory(r) for r in requests] + [plan_auto_seqs(requests[1])]
    from ferryman.envs import envs

    monkeypatch.setattr(envs, "KERNELS", envs.KERNELS)  # read now: the test's end restores it
    for name, value in HOSTILE_ENV.items():
        monkeypatch.setenv(name, value)
    envs.reload()  # the read-once variables see the hostile environment too
    for _ in range(2):
        assert [plan_memory(r) for r in requests] + [plan_auto_seqs(requests[1])] == clean


def test_resident_when_every_expert_fits_and_kv_takes_the_remainder() -> None:
    plan = plan_memory(_req("gpt-oss-20b", "40GiB", max_num_seqs=4))
    assert plan.strategy == "resident" and plan.expert_slots == plan.request.total_experts
    assert plan.kv_tokens == 4 * 32768  # everything the sequences can use
    small = plan_memory(_req("gpt-oss-20b", "20GiB", max_num_seqs=4, max_model_len=8192))
    assert small.strategy == "resident" and small.kv_tokens == 4 * 8192


def test_refusals_say_how_much_is_missing() -> None:
    # offloaded, 32 sequences reserve no 32 x 32768 tokens: the floor is one sequence + top_k slots
    assert plan_memory(_req("gpt-oss-120b", "16GiB", max_num_seqs=32)).strategy == "offload"
    req = _req("gpt-oss-120b", "3GiB", max_num_seqs=32)
    per_token = kv_bytes_per_token(req.cfg, torch.bfloat16, 18)  # the 18 full-attention layers
    window_pool = (1 + 32 * 19 + (2048 + 64) // 16) * 16 * per_token  # steps of a chunk and its tail
    geo = PageGeometry.of(16 * per_token, slot_bytes(req.cfg, torch.bfloat16))
    floor_pages = geo.pages_for_tokens(32768, 16) + 4  # + top_k slots
    need = (non_expert_bytes(req.cfg, torch.bfloat16) - host_embedding_bytes(req.cfg, torch.bfloat16)
            + window_pool + activation_bytes(req.cfg, torch.bfloat16, 2048 + 64, 32) + floor_pages * geo.page_bytes)
    with pytest.raises(ConfigError, match=rf"one sequence of 32768 tokens.*4 expert slots.*missing "
                                          rf"{(need - 3 * GiB) / GiB:.2f} GiB.*max_model_len \(32768\)"):
        plan_memory(req)
    with pytest.raises(ConfigError, match="every expert \\(resident\\).*missing"):
        plan_memory(_req("gpt-oss-120b", "16GiB", strategy="resident"))
    with pytest.raises(ConfigError, match="4608 expert slots.*missing"):
        plan_memory(_req("gpt-oss-120b", "16GiB", strategy="offload", expert_cache=1.0))


def test_explicit_cache_and_unlimited_budgets() -> None:
    plan = plan_memory(_req("gpt-oss-120b", "40GiB", expert_cache=0.1))
    assert plan.strategy == "offload" and plan.expert_slots == round(0.1 * 4608)
    # KV: one sequence is all one sequence can use, in whole pages
    assert plan.kv_tokens == plan.pages.pages_for_tokens(32768, 16) * plan.pages.blocks_per_page * 16
    plan = plan_memory(_req("gpt-oss-120b", None))
    assert plan.strategy == "resident" and plan.kv_tokens is None
    assert plan_memory(_req("gpt-oss-120b", None, expert_cache=100)).expert_slots == 100
    with pytest.raises(ConfigError, match="needs expert_cache"):
        plan_memory(_req("gpt-oss-120b", None, strategy="offload"))
    with pytest.raises(ConfigError, match="moe_strategy"):
        plan_memory(_req("gpt-oss-120b", None, strategy="hybrid"))


def test_cli_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-oss-120b", "--gpu-memory", "16GiB", "--max-num-seqs", "1"]) == 0
    out = capsys.readouterr().out
    assert "strategy: offload" in out and "budget:    16.00 GiB" in out
    assert main(["plan", "gpt-oss-120b", "--gpu-memory", "4GiB", "--max-num-seqs", "1"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["plan", "--gpu-memory", "1GiB"]) == 0  # the demo model fits
    assert "strategy: resident" in capsys.readouterr().out


def test_budget_drives_the_engine_with_the_cpu_as_device() -> None:
    """A budget too small for every expert: the engine offloads with the plan's slot count, and the
    greedy answer is the resident one."""
    cfg = model_config(DEMO_MODEL)
    dtype, seqs, ctx = torch.float32, 2, 256
    fixed = (non_expert_bytes(cfg, dtype) + seqs * ctx * kv_bytes_per_token(cfg, dtype)
             + activation_bytes(cfg, dtype, 64, seqs) + prefill_job_bytes(cfg, dtype, ctx))
    budget = fixed + 40 * slot_bytes(cfg, dtype) + 100  # room for 40 of the 320 experts
    kw = dict(device="cpu", dtype="float32", max_num_seqs=seqs, max_model_len=ctx, max_num_batched_tokens=64)
    llm = LLM(gpu_memory=budget, **kw)
    st = llm.stats()
    # offloaded: one region of pages for KV and expert slots; KV starts at its floor (one sequence)
    assert st["moe_strategy"] == "offload" and st["experts"]["slots"] == llm.engine.plan.expert_slots > 20
    assert seqs * ctx >= st["kv_cache_tokens"] >= ctx
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = LLM(**kw).generate(["def f(x):"], params)[0].token_ids
    assert llm.generate(["def f(x):"], params)[0].token_ids == want


@pytest.mark.gpu
def test_gpu_memory_caps_allocations_on_cuda() -> None:
    """In a fresh process: the cap is per process, and engines of earlier tests may still hold
    device memory in this one."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from ferryman import LLM\n"
        "llm = LLM(device='cuda', gpu_memory='2GiB', enforce_eager=True)\n"
        "assert llm.stats()['moe_strategy'] == 'resident'\n"
        "try:\n"
        "    torch.empty(3 << 30, dtype=torch.uint8, device='cuda')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('capped')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("capped"), out.stdout[-2000:]


def _auto(preset: str, budget_gib: float | None, max_model_len: int):
    from ferryman.planner import PlanRequest
    from ferryman.planner_search import plan_auto_seqs
    from ferryman.weights.presets import get_preset

    cfg = model_config(get_preset(preset))
    budget = None if budget_gib is None else int(budget_gib * GiB)
    return plan_auto_seqs(PlanRequest(cfg, torch.bfloat16, budget, max_model_len))


def test_auto_concurrency_leaves_experts_half_the_free_budget() -> None:
    from ferryman.planner import kv_bytes_per_token

    # 1.125 GiB of KV per 32k-token sequence in the 18 full-attention layers, and the window pool
    # offloaded, KV and expert slots share one region: concurrency reserves nothing, the largest is taken
    plan = _auto("gpt-oss-120b", 16, 32768)
    assert plan.request.max_num_seqs == 32 and plan.strategy == "offload" and plan.shared
    # a concurrency that keeps every expert resident is preferred (the 20b at 24 GiB: fewer than 32)
    small = _auto("gpt-oss-20b", 24, 32768)
    assert small.strategy == "resident" and small.request.max_num_seqs < 32
    free = small.request.budget - small.weights_bytes - small.activation_bytes
    per_seq = 32768 * kv_bytes_per_token(small.request.cfg, torch.bfloat16, 12)
    assert small.request.max_num_seqs * per_seq <= free
    assert _auto("gpt-oss-20b", 8, 2048).request.max_num_seqs == 32  # the window layers hold no context
    assert _auto("gpt-oss-20b", None, 32768).request.max_num_seqs == 32  # no budget: the default


def test_auto_concurrency_still_refuses_an_impossible_budget() -> None:
    with pytest.raises(ConfigError, match=r"one sequence of 32768 tokens.*missing .* GiB"):
        _auto("gpt-oss-20b", 3, 32768)  # 4 GiB fits one sequence since the window pool


def test_step_size_defaults_by_strategy_and_an_explicit_one_is_kept() -> None:
    from dataclasses import replace

    assert plan_memory(_req("gpt-oss-20b", "40GiB", max_num_seqs=4)).request.max_num_batched_tokens == 2048  # resident
    off = _req("gpt-oss-20b", "8GiB", max_num_seqs=1)
    assert plan_memory(off).request.max_num_batched_tokens == 4096
    assert plan_memory(replace(off, max_num_batched_tokens=1024)).request.max_num_batched_tokens == 1024
    # a budget that holds a 2048-token step but not a 4096-token one keeps 2048
    at_2048 = plan_memory(replace(off, max_num_batched_tokens=2048))
    extra = activation_bytes(off.cfg, torch.bfloat16, 4096, 1) - at_2048.activation_bytes
    tight = replace(off, budget=at_2048.total_bytes - at_2048.expert_cache_bytes
                    + off.cfg.top_k * at_2048.slot_bytes + extra // 2)
    assert plan_memory(tight).request.max_num_batched_tokens == 2048


def test_expandable_segments_are_turned_on_unless_the_user_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from ferryman.experts.placement import expandable_segments

    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "FERRYMAN_EXPANDABLE_SEGMENTS"):
        monkeypatch.delenv(name, raising=False)
    assert expandable_segments() and calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's word stands
    assert not expandable_segments() and len(calls) == 1
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # another allocator: left alone
    assert not expandable_segments() and len(calls) == 1


def test_expandable_segments_refused_by_torch_is_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    from ferryman.experts.placement import expandable_segments

    def refuse(conf: str) -> None:
        raise RuntimeError(f"unsupported: {conf}")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "FERRYMAN_EXPANDABLE_SEGMENTS"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level("WARNING", logger="ferryman.experts"):
        assert not expandable_segments()
    assert "expandable segments" in caplog.text and "unsupported" in caplog.text


def test_activation_estimate_carries_only_the_fixed_headroom() -> None:
    # gpt-oss-20b, a 4096-token chunk, one sequence: the H200 measured 0.85 GiB reserved for it
    # (docs/benchmarks.md); the estimate must stay above that, with its terms counted once
    cfg = _cfg("gpt-oss-20b")
    one = activation_bytes(cfg, torch.bfloat16, 4096, 1)
    assert 0.85 * GiB < one < 1.25 * GiB
    two, three = (activation_bytes(cfg, torch.bfloat16, n, 1) for n in (8192, 12288))
    assert three - two == two - one  # linear in the chunk: no factor on top
    assert activation_bytes(cfg, torch.bfloat16, 4096, 2) - one == 2 * cfg.vocab_size * 4  # one more logits row pair
