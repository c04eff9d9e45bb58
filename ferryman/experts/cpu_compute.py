"""Experts computed on the CPU straight from the host store: the CPU half of the hybrid split.

`CPUExperts.submit` takes the (token, k) pairs of one MoE layer routed to a given set of experts
(misses left in host memory), copies x and the routing weights to the host once for the layer,
and computes them from the host store's banks: a format the C kernel covers (MXFP4, dense bf16 /
fp32 / fp16) in one call (quant/cpu_layer.py `LayerJob`: OpenMP threads, no torch op in the worker),
other formats through `fused_moe` (torch's CPU kernels). The result is a [T, H] partial output in host memory, to be added to
the device's part. On CUDA it runs in one worker thread while the calling thread issues the
device's fetches and kernels (torch releases the GIL inside its kernels); on the CPU device it
runs inline (there is nothing to overlap with).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from ferryman.experts.host_store import HostExpertStore
from ferryman.layers.fused_moe import MoEActivation, fused_moe
from ferryman.quant import cpu_kernel
from ferryman.quant.cpu_layer import LayerJob, kernel_reads


class CPUExperts:
    def __init__(self, store: HostExpertStore, act: MoEActivation, threaded: bool) -> None:
        self.store, self.act = store, act
        self.num_experts = store.cfg.num_experts
        self.pool: ThreadPoolExecutor | None = None
        if threaded:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="ferryman-cpu-experts")
            weakref.finalize(self, self.pool.shutdown, wait=False)
        self.experts = 0  # experts computed (one per layer step and expert)
        self.pairs = 0  # (token, k) pairs computed
        self.seconds = 0.0  # time computing, on the worker
        self.wait_seconds = 0.0  # time the caller waited for a result
        self.bias: dict[tuple[int, int, str], torch.Tensor] = {}  # fp32 bias rows for the C kernel
        # per MoE layer: whether the C kernel reads its format (layers differ in GGUF mixes)
        self.kernel = {layer: kernel_reads(form.name, store.banks[layer]) for layer, form in store.formats.items()}

    def submit(self, layer: int, x: torch.Tensor, host_ids: torch.Tensor, topk_w: torch.Tensor,
               experts: list[int]) -> Future:
        """Start computing the pairs of `layer` routed to `experts` (distinct, in host memory).
        x: [T, H] on any device; host_ids: [T, K] expert ids on the host; topk_w: [T, K]."""
        start = time.perf_counter()  # the job's latency counts its copies, preparation and hand-off
        x_host, w_host = x.to("cpu"), topk_w.to("cpu")  # the one copy of each per layer
        fmt = self.store.formats[layer].name
        if self.kernel[layer]:
            # the whole layer in one kernel call, its arguments prepared here, so the worker runs no
            # torch op (beside the link's driver thread, torch ops there ran ~3x slower)
            pairs = cpu_kernel.pairs_of(host_ids, w_host, experts)
            job = LayerJob(x_host, self.store.banks[layer], layer, pairs, self.act.kind, self.act.alpha,
                           self.act.limit, self.bias, fmt)
            self.pairs += job.num_pairs
            run = partial(self._timed, lambda: job.run().to(x_host.dtype), len(experts), start)
        else:
            run = partial(self._timed, partial(self.compute, layer, x_host, host_ids, w_host, experts), len(experts),
                          start)
        if self.pool is not None:
            return self.pool.submit(run)
        done: Future = Future()
        done.set_result(run())
        return done

    def result(self, job: Future) -> tuple[torch.Tensor, float]:
        """(the [T, H] partial output in host memory, the job's latency: seconds from `submit` to
        the end of its computation) of a submitted job, waiting for it if needed."""
        start = time.perf_counter()
        out, seconds = job.result()
        self.wait_seconds += time.perf_counter() - start
        return out, seconds

    def _timed(self, compute: Callable[[], torch.Tensor], experts: int, submitted: float) -> tuple[torch.Tensor, float]:
        """(compute()'s result, seconds since `submitted`); cpu_seconds counts the computation alone."""
        start = time.perf_counter()
        with torch.inference_mode():  # thread-local: the worker does not inherit the caller's
            out = compute()
        end = time.perf_counter()
        self.seconds += end - start
        self.experts += experts
        return out, end - submitted

    def compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                experts: list[int]) -> torch.Tensor:
        """sum over the pairs (t, k) with ids[t, k] in `experts` of w[t, k] * expert(x[t]) -> [T, H].
        All tensors on the host; x: [T, H], ids, w: [T, K]."""
        mine = torch.isin(ids, torch.tensor(experts, dtype=ids.dtype))  # [T, K]
        tok, kk = mine.nonzero(as_tuple=True)  # [P]
        eid = ids[tok, kk].long()  # [P]
        # per token in ascending expert order: the order fused_moe's reference accumulates in
        order = torch.argsort(tok * self.num_experts + eid)
        tok, kk, eid = tok[order], kk[order], eid[order]
        y = fused_moe(self.store.formats[layer].name, self.store.banks[layer], x[tok], eid[:, None],
                      w[tok, kk][:, None], self.act)
        self.pairs += int(tok.numel())
        return torch.zeros_like(x).index_add_(0, tok, y)  # [T, H]

    def stats(self) -> dict:
        return {"cpu_computed": self.experts, "cpu_pairs": self.pairs, "cpu_seconds": self.seconds,
                "cpu_wait_seconds": self.wait_seconds, "cpu_threads": torch.get_num_threads()}
