"""Measuring this machine for one model's experts: what `ferryman bench bw` and the hybrid split use.

    host read    torch.sum over a large buffer (all torch threads): the ceiling of any CPU kernel
    link         pinned host -> device copies of one expert (one row of the HostExpertStore)
    host copy    the same copies host -> host (the "link" when the CPU is the device)
    cpu compute  `fused_moe` on CPU tensors, 1 token x top-k experts of the model's shape and format
    overlapped   (CUDA) the link and the CPU compute running at the same time: they share the host
                 memory bus, so each is slower than alone, and that is the rate a split gets
    device       (CUDA) a prefill chunk's MoE layer and a GEMM on the device (calibrate/device.py)

A repetition touches experts the previous ones did not (a cycle over a pool larger than the CPU's
caches, or over the real store), so weights come from DRAM as in serving. Every figure is the
median of several timed repetitions after a warm-up; the overlapped one is a count over a timed
window. Nothing is assumed: a rate that was not measured is None.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ferryman.calibrate.calibration import (
    CPU_SLOPE_TOKENS,
    Calibration,
    Rate,
    expert_key,
    machine_info,
    save,
    token_slope,
)
from ferryman.calibrate.device import measure_device_compute
from ferryman.calibrate.timing import median_seconds, sync
from ferryman.config import ModelConfig
from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant.base import Banks, get_format
from ferryman.quant.layout import allocate_rows

Rep = Callable[[], None]  # one timed repetition (waits for its own work)
Log = Callable[[str], None]
MiB = 1 << 20
QUICK_SECONDS = 0.1  # per measurement at engine start: a few hundred ms in all (one slow rep may exceed it)


def measure(rep: Rep, experts_per_rep: int, expert_bytes: int, reps: int, budget_s: float | None = None) -> Rate:
    """The median rate of `rep`; with a budget (engine start) as few as one timed rep after the
    warm-up, so a slow CPU kernel (seconds per expert) does not hold the start for long."""
    seconds, done = median_seconds(rep, reps, budget_s=budget_s, min_reps=3 if budget_s is None else 1)
    return Rate.of(seconds / experts_per_rep, expert_bytes, done)


class ExpertCycle:
    """(pool, expert ids) of the next repetition: k consecutive experts, walking over every expert
    of every pool, so a repetition does not find the previous one's weights in the CPU caches."""

    def __init__(self, pools: int, experts: int, k: int) -> None:
        if not 0 < k <= experts or pools < 1:
            raise ValueError(f"need 0 < k <= experts per pool and a pool, got k={k}, experts={experts}, pools={pools}")
        self.pools, self.experts, self.k, self.pos = pools, experts, k, 0

    def next(self) -> tuple[int, list[int]]:
        pool, start = divmod(self.pos, self.experts)
        self.pos = (self.pos + self.k) % (self.pools * self.experts)
        return pool % self.pools, [(start + i) % self.experts for i in range(self.k)]


def host_read_gbps(nbytes: int, reps: int) -> float:
    """GB/s of torch.sum over an `nbytes` fp32 buffer, all torch threads."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    seconds, _ = median_seconds(lambda: buf.sum(), reps)
    return buf.numel() * 4 / seconds / 1e9


def rows_copy_rep(rows: list[torch.Tensor], dst: torch.Tensor, k: int) -> Rep:
    """Copy k distinct expert rows (`rows[i]`: [E, row_bytes] uint8) into dst[:k], and wait."""
    cycle = ExpertCycle(len(rows), rows[0].shape[0], k)

    def rep() -> None:
        pool, ids = cycle.next()
        for i, e in enumerate(ids):
            dst[i].copy_(rows[pool][e], non_blocking=True)
        sync(dst.device)

    return rep


def cpu_compute_rep(fmt: str, banks: list[Banks], top_k: int, act: MoEActivation, dtype: torch.dtype,
                    tokens: int = 1) -> Rep:
    """`tokens` tokens, each routed to the same top_k distinct experts of `banks`, on the CPU, the
    way the hybrid split computes them (experts/cpu_compute.py: a format the C kernel covers in one
    kernel call, else fused_moe). Each rep computes top_k experts."""
    from ferryman.quant.cpu_kernel import pairs_of
    from ferryman.quant.cpu_layer import LayerJob, kernel_reads

    form = get_format(fmt)
    num, hidden, _ = form.dims(banks[0])
    cycle = ExpertCycle(len(banks), num, top_k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).to(dtype)  # [T, H]
    w = torch.full((tokens, top_k), 1.0 / top_k)  # [T, K]
    bias: dict = {}  # the hybrid keeps the kernel's fp32 bias rows between steps too
    kernel = kernel_reads(fmt, banks[0])

    def rep() -> None:
        pool, ids = cycle.next()
        ids_t = torch.tensor([ids] * tokens)  # [T, K]
        if kernel:  # the hybrid's path: one kernel call per layer
            LayerJob(x, banks[pool], pool, pairs_of(ids_t, w), act.kind, act.alpha, act.limit, bias, fmt).run()
        else:
            fused_moe(fmt, banks[pool], x, ids_t, w, act)

    return rep


def overlapped(link: Rep, link_experts: int, cpu: Rep, cpu_experts: int, expert_bytes: int,
               seconds: float) -> dict[str, Rate]:
    """The link and the CPU compute running together for `seconds`: {"link", "cpu"} rates (each
    loop counts the experts it finished in its own elapsed time)."""
    link()  # warm-up, one each
    cpu()
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)

    def loop(rep: Rep, per_rep: int) -> Rate:
        done, start = 0, time.perf_counter()
        while not stop.is_set():
            rep()
            done += per_rep
        elapsed = time.perf_counter() - start
        return Rate.of(elapsed / done, expert_bytes, done)

    with ThreadPoolExecutor(1, thread_name_prefix="ferryman-bw") as pool:
        cpu_rate = pool.submit(torch.inference_mode()(loop), cpu, cpu_experts)
        timer.start()
        try:
            link_rate = loop(link, link_experts)
        finally:
            stop.set()  # the CPU loop ends even when the link loop failed
            timer.cancel()
        return {"link": link_rate, "cpu": cpu_rate.result()}


# ---- `ferryman bench bw`: dummy experts of the model's shape --------------------------------------


def _pool_size(expert_bytes: int, k: int, pool_bytes: int) -> int:
    """Experts in a dummy pool: enough bytes to spill the CPU caches, at least 2 x top-k."""
    return max(2 * k, -(-pool_bytes // max(1, expert_bytes)))


def dummy_cpu_rep(cfg: ModelConfig, dtype: torch.dtype, act: MoEActivation, pool_bytes: int,
                  tokens: int = 1) -> Rep:
    fmt = get_format(cfg.expert_format)
    eb = fmt.expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, dtype)
    n = _pool_size(eb, cfg.top_k, pool_bytes)
    gen = torch.Generator().manual_seed(0)
    banks = fmt.random_banks(n, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_bias, dtype, gen)
    return cpu_compute_rep(cfg.expert_format, [banks], cfg.top_k, act, dtype, tokens)


def dummy_copy_rep(row_bytes: int, k: int, pool_bytes: int, device: torch.device) -> tuple[Rep, bool]:
    """(copies of k rows from a pool of expert rows, whether the pool is pinned: it is asked to be
    when the target is a GPU, as the host store's rows are)."""
    rows, pinned = allocate_rows(_pool_size(row_bytes, k, pool_bytes), row_bytes, pin=device.type == "cuda")
    rows.fill_(1)  # touch every page before timing
    dst = torch.empty((k, row_bytes), dtype=torch.uint8, device=device)
    return rows_copy_rep([rows], dst, k), pinned


def run_bench(cfg: ModelConfig, dtype: torch.dtype, act: MoEActivation, path: Path, reps: int = 10,
              read_bytes: int = 1 << 30, pool_bytes: int = 256 * MiB, log: Log = print) -> Calibration:
    """Measure everything for `cfg`'s experts in `dtype`, write `path`, log each figure as it lands."""
    key, machine = expert_key(cfg, dtype), machine_info()
    k, eb, row = cfg.top_k, key["expert_bytes"], key["row_bytes"]
    log(f"machine: {machine['cpu']}, {machine['cpus']} CPUs, {machine['threads']} torch threads, "
        f"GPU {machine['gpu'] or 'none'}, torch {machine['torch']}")
    log(f"expert: {key['format']} {key['dtype']}, hidden {key['hidden']}, FFN {key['inter']}, top-{k}, "
        f"{eb / MiB:.3f} MiB ({row} bytes per host-store row); {reps} reps each, median")
    log(f"(a) host read bandwidth: torch.sum over {read_bytes / MiB:.0f} MiB ...")
    read = host_read_gbps(read_bytes, reps)
    log(f"    host read: {read:.1f} GB/s")
    h2d, h2d_rep, notes = None, None, {}
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    if cuda is None:
        notes["h2d"] = "skipped: no CUDA device on this machine"
        log("(b) pinned host -> device copies: skipped, no CUDA device on this machine")
    else:
        log(f"(b) pinned host -> device copies of one expert row, {k} per rep ...")
        h2d_rep, pinned = dummy_copy_rep(row, k, pool_bytes, cuda)
        if not pinned:  # what the engine's store gets too when cudaHostRegister is refused
            notes["h2d"] = "pinning failed (locked-memory quota?): pageable copies measured"
            log(f"    warning: {notes['h2d']}")
        h2d = measure(h2d_rep, k, row, reps)
        log(f"    link: {_rate(h2d)}")
    log(f"    host -> host copies of one expert row, {k} per rep ...")
    host_copy = measure(dummy_copy_rep(row, k, pool_bytes, torch.device("cpu"))[0], k, row, reps)
    log(f"    host copy: {_rate(host_copy)}")
    log(f"(c) CPU expert compute, the hybrid's path: 1 token x {k} experts ...")
    cpu_rep = dummy_cpu_rep(cfg, dtype, act, pool_bytes)
    cpu = measure(cpu_rep, k, eb, reps)
    log(f"    CPU compute: {_rate(cpu)} ({cpu.gbps / read:.0%} of host read bandwidth)")
    cpu_tokens = measure(dummy_cpu_rep(cfg, dtype, act, pool_bytes, CPU_SLOPE_TOKENS), k, eb, reps)
    log(f"    {CPU_SLOPE_TOKENS} tokens per expert: {_rate(cpu_tokens)}, so each token past the first costs "
        f"{token_slope(cpu.experts_per_s, cpu_tokens.experts_per_s):.2f} of a 1-token expert")
    both, device = None, None
    if h2d_rep is None or cuda is None:
        log("(d) GPU compute: no CUDA device")
    else:
        log("(d) GPU compute: one MoE layer of a prefill chunk, and a GEMM (`ferryman plan`'s TTFT) ...")
        device = measure_device_compute(cfg, dtype, act, cuda, reps)
        moe = ", ".join(f"{t} tokens {s * 1e3:.2f} ms" for t, s in device.moe)
        log(f"    MoE layer: {moe}; GEMM {device.matmul_flops / 1e12:.0f} TFLOP/s")
        log("    link and CPU together for 2 s ...")
        both = overlapped(h2d_rep, k, cpu_rep, k, eb, 2.0)
        log(f"    together: link {_rate(both['link'])}, CPU {_rate(both['cpu'])}")
    cal = Calibration(key, machine, cpu, host_copy, h2d, read, both, quick=False, notes=notes, cpu_tokens=cpu_tokens,
                      device=device)
    save(cal, path)
    log(f"wrote {path}")
    return cal


def _rate(r: Rate) -> str:
    return f"{r.experts_per_s:,.0f} experts/s, {r.gbps:.2f} GB/s of expert bytes"


# ---- engine start: the engine's own store and slot pool, a few hundred ms -----------------------


def quick_calibration(store: Any, link_rep: Rep, k: int, device: torch.device, act: MoEActivation,
                      seconds: float = QUICK_SECONDS, overlap_share: float = 0.0) -> Calibration:
    """Rates for the engine's experts from its own host store (experts/host_store.py: cfg, dtype,
    banks, flat rows) and `link_rep`, k experts copied into its slot pool (nothing is written). On
    CUDA the link and the CPU are also measured together, unless the CPU alone is below
    `overlap_share` x the link (it only gets slower together, and a slow CPU kernel would hold the
    start for seconds)."""
    cfg, dtype = store.cfg, store.dtype
    # mixed formats (GGUF): the layers of the most common one
    layers = [i for i in cfg.moe_layers if cfg.expert_format_of(i) == cfg.expert_format]
    key = expert_key(cfg, dtype)
    eb, row = key["expert_bytes"], key["row_bytes"]
    link = measure(link_rep, k, row, reps=50, budget_s=seconds)
    cpu_rep = cpu_compute_rep(store.format.name, [store.banks[layer] for layer in layers], cfg.top_k, act, dtype)
    cpu = measure(cpu_rep, cfg.top_k, eb, reps=50, budget_s=seconds)
    many = cpu_compute_rep(store.format.name, [store.banks[layer] for layer in layers], cfg.top_k, act, dtype,
                           CPU_SLOPE_TOKENS)
    cpu_tokens = measure(many, cfg.top_k, eb, reps=50, budget_s=seconds)
    if device.type != "cuda":  # the slot pool is in host memory: its copies are host copies
        return Calibration(key, machine_info(), cpu, link, quick=True, cpu_tokens=cpu_tokens)
    host_dst = torch.empty((k, store.flat[layers[0]].shape[1]), dtype=torch.uint8)
    host_copy = measure(rows_copy_rep([store.flat[layer] for layer in layers], host_dst, k), k, row,
                        reps=50, budget_s=seconds)
    both = None
    if cpu.experts_per_s >= overlap_share * link.experts_per_s:
        both = overlapped(link_rep, k, cpu_rep, cfg.top_k, eb, seconds)
    return Calibration(key, machine_info(), cpu, host_copy, link, None, both, quick=True, cpu_tokens=cpu_tokens)
