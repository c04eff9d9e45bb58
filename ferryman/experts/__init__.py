"""Routed experts: where they live and the path a miss takes.

    placement   resident (every expert on the device) or offloaded, from the memory plan
    host_store  every expert in pinned host RAM, one row of bytes per expert
    gpu_cache   device slots (slot_table: keys, pins; policies: lru | lrfu) and counters
    transfer    host -> device copies on a copy stream, ordered against the kernels by events
    plan        per MoE layer: hits, misses to fetch, misses for the CPU, guesses to prefetch
    offload     the executor: carries a plan out, eagerly or around a layer's CUDA graph
    cpu_compute misses computed on the CPU from the host store (hybrid: the split's answer)
    guesses     the next layer's experts, guessed and graded
"""
