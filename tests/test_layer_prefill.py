"""Layer-major prefill (engine/prefill_job.py, engine/layer_prefill.py): a prompt longer than a step
passes each layer in all its chunks, so each uncached expert crosses the link once per prompt and
layer. Checked against chunk-major prefill of the same offloaded engine (which test_offload_identity
ties to the resident engine, and test_hf_parity to transformers): the same greedy tokens, with
other sequences decoding between the job's layer groups."""

from __future__ import annotations

import json

import pytest
import torch

from ferryman import LLM, SamplingParams
from ferryman.engine.llm_engine import LLMEngine
from tiny_models import build_tiny

CHUNK = 32
# the uniform-routing model of benchmarks/bench_prefill_stream.py, smaller: every chunk touches
# about every expert, as long prompts do on real models
UNIFORM = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "intermediate_size": 128,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32",
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    made: dict[str, str] = {}

    def folder(arch: str) -> str:
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            build_tiny(arch, path)
            made[arch] = str(path)
        return made[arch]

    return folder


@pytest.fixture(scope="module")
def uniform_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("uniform")
    (folder / "config.json").write_text(json.dumps(UNIFORM))
    return str(folder)


def _engine(model: str, mode: str, **kw) -> LLMEngine:  # noqa: ANN003
    opts = dict(device="cpu", moe_strategy="offload", expert_cache="60%", max_num_batched_tokens=CHUNK,
                enforce_eager=True, prefill_mode=mode)
    return LLM(model, **{**opts, **kw}).engine


def _run_interleaved(eng: LLMEngine, short: list[list[int]], long: list[list[int]], n: int) -> tuple[list, list]:
    """Start the short prompts, step until they decode, then add the long ones; run to the end.
    Returns (greedy tokens per request, per step (job layers, whether a decode ran))."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in short]
    while not all(eng.requests[i].seq.num_output_tokens >= 2 for i in ids):
        eng.step()
    ids += [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) for p in long]
    steps: list[tuple[int, bool]] = []
    schedule = eng.scheduler.schedule

    def recorded():  # noqa: ANN202
        out = schedule()
        steps.append((out.job_layers, any(s.is_decode for s in out.scheduled)))
        return out

    eng.scheduler.schedule = recorded
    while eng.has_unfinished():
        eng.step()
    return [eng.pop_output(i).token_ids for i in ids], steps


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int = 250) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "glm4_moe", "mixtral", "deepseek_v3"])
def test_layer_major_matches_chunk_major_beside_decodes(arch: str, device: str, tiny_folder) -> None:  # noqa: ANN001
    """Two long prompts (one job: they arrive together) beside two decoding sequences: every
    sequence's greedy tokens equal chunk-major prefill's. gpt-oss's sliding-window layers run
    through the job's block ring (a 100-token prompt wraps a 5-block ring of 16-token blocks).
    On CUDA the same kernels see the same chunks, so the tokens are equal there too."""
    model = tiny_folder(arch)
    short, long = _prompts(0, (7, 12)), _prompts(1, (100, 45))
    want, _ = _run_interleaved(_engine(model, "chunk", device=device), short, long, 24)
    eng = _engine(model, "layer", device=device)
    got, steps = _run_interleaved(eng, short, long, 24)
    assert got == want
    jobs = eng.prefill_jobs
    assert jobs["jobs"] == 1 and jobs["decode_steps"] > 0, jobs
    # the stall bound: beside a decode, a step runs at most layers_per_step of the job's layers
    bound = max(1, eng.cfg.num_layers * CHUNK // 145)
    assert max(layers for layers, decoding in steps if decoding) <= bound
    assert eng.scheduler.pool.usage == 0.0  # every block went back


def test_the_demo_model_gives_the_same_tokens() -> None:
    short, long = [[5, 17, 42, 7, 99]], _prompts(2, (90,), vocab=4000)
    kw = dict(dtype="float32", expert_cache="50%")
    want, _ = _run_interleaved(_engine(None, "chunk", **kw), short, long, 12)
    got, _ = _run_interleaved(_engine(None, "layer", **kw), short, long, 12)
    assert got == want


def _fetched(eng: LLMEngine) -> dict[int, int]:
    cache = eng.runner.experts.cache
    c = cache.counters
    return {layer: c.misses.get(layer, 0) + c.prefetch_fetched.get(layer, 0) for layer in cache.moe_index}


@pytest.mark.parametrize("length, factor", [(3 * CHUNK, 1.5), (CHUNK + 3, 1.2)])
def test_each_expert_crosses_once_per_prompt_and_layer(uniform_model: str, length: int, factor: float) -> None:
    """With a cold cache, a prompt of several chunks (or of one chunk and a 3-token tail) copies each
    expert of each layer at most once in layer-major prefill; chunk-major copies again what each
    chunk touches beyond the experts it keeps (routing here touches every expert per full chunk;
    the tail's 12 pairs about half of them)."""
    experts = UNIFORM["num_experts"]
    prompt = _prompts(3, (length,), vocab=500)
    moved = {}
    for mode in ("layer", "chunk"):
        eng = _engine(uniform_model, mode, load_format="dummy", expert_cache="75%")
        params = SamplingParams(max_tokens=1)
        eng.add_request(prompt[0], params)
        while eng.has_unfinished():
            eng.step()
        moved[mode] = _fetched(eng)
    assert all(n <= experts for n in moved["layer"].values()), moved
    assert sum(moved["chunk"].values()) > factor * sum(moved["layer"].values()), moved


def test_prompts_arriving_together_share_one_stream(uniform_model: str) -> None:
    eng = _engine(uniform_model, "layer", load_format="dummy", expert_cache="75%")
    for p in _prompts(4, (2 * CHUNK, 2 * CHUNK, 20), vocab=500):
        eng.add_request(p, SamplingParams(max_tokens=2))
    eng.step()  # nothing decodes beside it: the whole job in one step
    assert eng.prefill_jobs["jobs"] == 1 and eng.scheduler.job is None
    assert all(n <= UNIFORM["num_experts"] for n in _fetched(eng).values())
    assert len(eng.scheduler.running) == 3


def test_an_abort_during_the_job_returns_blocks_after_it(tiny_folder) -> None:  # noqa: ANN001
    eng = _engine(tiny_folder("gpt_oss"), "layer")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))  # decoding beside the job
    eng.step()
    first, second = (eng.add_request(p, params) for p in _prompts(5, (80, 70)))
    eng.step()
    assert eng.scheduler.job is not None and eng.scheduler.job.layers_done == 1
    eng.abort(first)
    while eng.has_unfinished():
        eng.step()
    assert eng.pop_output(first).finish_reason == "abort"
    assert len(eng.pop_output(second).token_ids) == 3
    assert eng.scheduler.pool.usage == 0.0
    window = eng.scheduler.window_pool
    assert all(window.blocks[b].ref_count == 0 for b in range(1, window.num_blocks))


def test_hybrid_models_keep_chunk_major(tiny_folder) -> None:  # noqa: ANN001
    """Gated DeltaNet layers carry a state from chunk to chunk and checkpoint it after a chunk's last
    layer: the planner keeps them chunk-major (their tokens: tests/test_hybrid*.py)."""
    eng = _engine(tiny_folder("qwen3_next"), "auto")
    assert eng.plan.prefill_job_tokens == 0 and eng.stats()["prefill_mode"] == "chunk"


def test_resident_experts_keep_chunk_major(tiny_folder) -> None:  # noqa: ANN001
    eng = LLM(tiny_folder("qwen3_moe"), device="cpu", max_num_batched_tokens=CHUNK, enforce_eager=True).engine
    assert eng.plan.strategy == "resident" and eng.plan.prefill_job_tokens == 0


def test_a_bad_mode_is_refused() -> None:
    from ferryman.config import EngineConfig
    from ferryman.errors import ConfigError

    with pytest.raises(ConfigError, match="prefill_mode must be one of auto, layer, chunk"):
        EngineConfig(model="x", prefill_mode="rows")


def test_the_planner_chooses_the_mode() -> None:
    """Offloaded: layer-major with the job's hidden states in the plan; chunk when asked, or when
    those states do not fit beside the floor (auto); `layer` then refuses with the shortfall."""
    from ferryman.errors import ConfigError
    from ferryman.planner import PlanRequest, prefill_job_bytes
    from ferryman.planner_search import plan_memory
    from tiny_models import preset_config

    cfg = preset_config("gpt-oss-20b")
    req = PlanRequest(cfg, torch.bfloat16, 8 << 30, 32768, max_num_seqs=2)
    layered, chunked = plan_memory(req), plan_memory(PlanRequest(**{**req.__dict__, "prefill_mode": "chunk"}))
    assert layered.prefill_job_tokens == 32768 and chunked.prefill_job_tokens == 0
    job = prefill_job_bytes(cfg, torch.bfloat16, 32768)
    assert layered.activation_bytes - chunked.activation_bytes == job == 2 * 32768 * cfg.hidden_size * 2
    assert chunked.expert_slots - layered.expert_slots in (job // chunked.slot_bytes, job // chunked.slot_bytes + 1)
    # a budget with room for the floor and the experts' minimum but not for the job's states
    tight = chunked.total_bytes - (chunked.expert_slots - cfg.top_k) * chunked.slot_bytes + job // 2
    auto = plan_memory(PlanRequest(**{**req.__dict__, "budget": tight}))
    assert auto.strategy == "offload" and auto.prefill_job_tokens == 0
    with pytest.raises(ConfigError, match="cannot hold the floor"):
        plan_memory(PlanRequest(**{**req.__dict__, "budget": tight, "prefill_mode": "layer"}))


def test_the_window_ring_and_its_fold() -> None:
    """A job's window layers cycle through a ring of blocks (exact ids); at its end the table is what
    chunk-major prefill leaves (the last window, NULL before it) and the rest of the ring is free."""
    from ferryman.engine.prefill_job import ring_blocks
    from ferryman.engine.sequence import Sequence
    from ferryman.kvcache.window_pool import NULL_BLOCK, WindowBlockPool, ring_table

    pool = WindowBlockPool(num_blocks=20, block_size=4, window=4)
    seq = Sequence(list(range(5, 35)), SamplingParams())  # 30 tokens, 8 blocks
    ring = min(ring_blocks(4, 8, 4), 8)  # chunks of 8 tokens: cdiv(8 + 4, 4) + 2
    assert ring == 5
    pool.grow(seq, ring * 4)
    assert seq.window_table == [1, 2, 3, 4, 5]
    # positions 16..23 see from position 13 (block 3) on; block 5 wraps onto the ring's first
    assert ring_table(seq.window_table, 4, 4, 0, ring, 16, 24) == [NULL_BLOCK] * 3 + [4, 5, 1]
    pool.fold_ring(seq, 0, ring, 30)
    assert seq.window_table == [NULL_BLOCK] * 6 + [2, 3]  # blocks 6 and 7 sit in ring slots 1 and 2
    assert sorted(b for b in range(1, 6) if pool.blocks[b].ref_count == 0) == [1, 4, 5]
    seq.num_computed_tokens = 30
    pool.release_stale(seq)  # nothing more to release: the fold left what it would
    assert seq.window_table == [NULL_BLOCK] * 6 + [2, 3]


def test_the_scheduler_runs_a_job_beside_decodes() -> None:
    """Exact steps: a 100-token prompt beside a decoding sequence runs max(1, 4 x 32 // 100) = 1 layer
    per step, samples on the 4th, then decodes; alone, a prompt runs every layer in one step."""
    from ferryman.engine.scheduler import Scheduler, SchedulerConfig
    from ferryman.engine.sequence import Sequence

    sched = Scheduler(SchedulerConfig(max_model_len=256, num_blocks=64, max_num_batched_tokens=32, num_layers=4,
                                      prefill_job_tokens=256))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    user, long = Sequence(list(range(5, 10)), params), Sequence(list(range(5, 105)), params)
    sched.add(user)
    sched.update(sched.schedule(), {user.seq_id: 1})  # the user's prompt: one chunk, chunk-major
    sched.add(long)
    layers = []
    for step in range(4):
        out = sched.schedule()
        assert [s.seq for s in out.scheduled] == [user] and out.scheduled[0].is_decode
        layers.append(out.job_layers)
        if step == 0:
            assert [[(p.start_pos, p.num_tokens) for p in c] for c in out.job_started.chunks] == \
                [[(0, 32)], [(32, 32)], [(64, 32)], [(96, 4)]]
            assert len(long.block_table) == 7 and sched.running == [user]  # all its blocks, outside running
        assert [(s.seq, s.num_tokens, s.sample) for s in out.job_finished] == ([(long, 100, True)] if step == 3 else [])
        sched.update(out, {s.seq.seq_id: 2 for s in [*out.job_finished, *out.scheduled] if s.sample})
    assert layers == [1, 1, 1, 1] and sched.job is None
    assert sched.running == [user, long] and long.num_computed_tokens == 100 and long.output_token_ids == [2]
    alone = Sequence(list(range(200, 270)), params)  # no cached prefix: all 70 tokens to compute
    sched.finish(user.seq_id, "abort")
    sched.finish(long.seq_id, "abort")
    sched.add(alone)
    out = sched.schedule()
    assert out.job_layers == 4 and out.job_finished[0].seq is alone and not out.scheduled


def test_a_job_takes_a_short_tail_in_its_last_chunk(tiny_folder) -> None:  # noqa: ANN001
    """chunk // 32 = 1 token past a chunk joins the chunk before it (prefill_steps.piece_tokens), in both modes:
    the packing, then the same greedy tokens from a 65-token and a 97-token prompt (chunks 32 + 33 and
    32 + 32 + 33; gpt-oss's window ring sized for 33-token pieces)."""
    from ferryman.engine.prefill_job import pack_chunks
    from ferryman.engine.sched_types import JobPiece
    from ferryman.engine.sequence import Sequence

    params = SamplingParams(max_tokens=1)
    a, b = Sequence(list(range(5, 35)), params), Sequence(list(range(5, 40)), params)
    chunks = pack_chunks([JobPiece(a, 0, 30), JobPiece(b, 0, 35)], CHUNK)
    assert [[(p.seq, p.start_pos, p.num_tokens) for p in c] for c in chunks] == [[(a, 0, 30), (b, 0, 2)], [(b, 2, 33)]]
    model = tiny_folder("gpt_oss")
    short, long = _prompts(5, (6,)), _prompts(6, (2 * CHUNK + 1, 3 * CHUNK + 1))
    want, _ = _run_interleaved(_engine(model, "chunk"), short, long, 8)
    eng = _engine(model, "layer")
    started = []
    schedule = eng.scheduler.schedule

    def recorded():  # noqa: ANN202
        out = schedule()
        if out.job_started is not None:
            started.append([sum(p.num_tokens for p in c) for c in out.job_started.chunks])
        return out

    eng.scheduler.schedule = recorded
    got, _ = _run_interleaved(eng, short, long, 8)
    assert got == want
    assert started == [[CHUNK, CHUNK + 1, CHUNK, CHUNK, CHUNK + 1]], started


@pytest.mark.parametrize("slots_pct", ["15%", "30%"])
def test_a_chunk_beyond_the_free_slots_falls_back_to_chunk_by_chunk(uniform_model: str, slots_pct: str) -> None:
    """forward_chunks plans each chunk as its routing lands, the earlier chunks' experts held pinned:
    a first chunk on 4 experts, then chunks on all 16. With 10 slots the second chunk does not fit
    beside the first's pins, and it and the rest go through `forward` one by one; with 19 every chunk
    runs under its plan. Either way each chunk's output equals `forward` on its own (chunk-major)."""
    eng = _engine(uniform_model, "layer", load_format="dummy", expert_cache=slots_pct)
    experts, k = eng.runner.experts, UNIFORM["num_experts_per_tok"]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3 * 20, UNIFORM["hidden_size"], generator=gen)
    bounds = [(0, 20), (20, 40), (40, 60)]
    ids = [torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(20)]) for _ in bounds]
    ids[0] = torch.tensor([[0, 1, 2, 3]] * 20)  # the first chunk on 4 experts only
    routed = [(i, torch.softmax(torch.randn(20, k, generator=gen), dim=-1)) for i in ids]
    want = [experts.forward(0, x[a:b], *r) for (a, b), r in zip(bounds, routed)]
    reads = [experts.read_routing(0, x[a:b], r[0], c == 0) for c, ((a, b), r) in enumerate(zip(bounds, routed))]
    got: dict[int, torch.Tensor] = {}
    one_by_one: list[int] = []
    real = experts.forward
    experts.forward = lambda layer, xc, *r: one_by_one.append(xc.shape[0]) or real(layer, xc, *r)  # type: ignore
    experts.forward_chunks(0, x.clone(), bounds, routed, reads, lambda c, out: got.__setitem__(c, out))
    assert sorted(got) == [0, 1, 2] and one_by_one == ([20, 20] if slots_pct == "15%" else [])
    for c in range(3):  # the same pairs; the slots, and so the order of a token's sum, may differ
        torch.testing.assert_close(got[c], want[c], rtol=1e-5, atol=1e-6)
    assert experts.cache.available() == experts.cache.table.num_active  # nothing left pinned
