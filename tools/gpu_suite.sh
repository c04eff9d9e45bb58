#!/usr/bin/env bash
# Everything ferryman checks on the GPU machine, in stages, each with its own time limit, logs in
# $OUT (or ./gpu-out), packed into $OUT/suite.tgz at the end. Plan one or two `device run` calls
# (10 minutes each at most):
#   tools/fetch_device_wheels.sh                      # here, once per session (server stages)
#   device run --carry .whl: tools/gpu_suite.sh "tests uva decode"        # ~5 min
#   device run --carry .whl: tools/gpu_suite.sh offloadab                 # ~8 min, A/Bs of defaults
#   device run --carry .whl: tools/gpu_suite.sh "offload20 offload120 offloadqwen serve"
# Stages: tests; grouped (the 300-token grouped-kernel test, apart); decode (two runs); fusek;
#   kernels; prefix; offload20, offload120, offloadqwen (one target each); offload20pf (gpt-oss-20b decode with
#   early decode prefetch); late (gpt-oss-20b and -120b decode with late decode prefetch);
#   prefillab (TTFT 4k + prefill 8k: reference vs FERRYMAN_MOE_PREFILL=batched); gtests (the GPU tests of the offload path and parity only); offloadab (gpt-oss-20b
#   decode A/Bs: layer graphs, prefetch, pool layout, zero-copy; prefill: reference vs grouped;
#   qwen3 with CPU-computed misses); offload (all three); diag (tools/diag_offload.py:
#   where offloaded decode and prefill time goes); diagpre (prefill profiles: reference, batched groups of
#   4 and 16, 120b); hybrid (the hybrid GPU tests); dequant
#   (bench_dequant.py); qtests (the prefill MoE GPU tests); lookab (120b prefill, lookahead 1 vs 2);
#   lateab (decode with and without late prefetch, in one call); embab (20b, embedding table on the
#   device vs in host RAM); expab (20b, the caching allocator's expandable segments off vs on: peak
#   reserved memory, retries); ltests (GPU tests of late/late2 prefetch, holds, planner); late2ab (decode
#   off / late / late2 through FERRYMAN_DECODE_PREFETCH, no rebind: 20b, and 120b off / late2); late2ab20
#   (its 20b half); pakab (speculative copies after the kernels: 120b prefill, 20b on vs off); pak120ab
#   (120b 8k prefill, off vs on); serveab (20b at 8 GiB, 16 users: default, late, late2, fp8 KV, late + fp8 KV); hyb (bench bw, 20b decode off vs --cpu-experts auto, 16-user serve auto vs default, 120b decode auto); hybt (hybrid and segment-graph GPU tests); hyb3 (CPU kernel rates, bench bw, 16-user serve auto / default / auto, 20b decode auto); bd16 (CPU kernel rates, bench bw, 16-sequence decode: prefetch off / early, hybrid off / on, in turn); ab3 (bench bw; 16-, 4- and 1-sequence decode off / hybrid / early + hybrid; 16-user serve default vs early + auto); fin5 (16-user serve: the CLI defaults, then the old ones); gapab (gap guesses: GPU test, then one-sequence decode without / with 1 / 2 gap copies, 20b and 120b); st2 (one-sequence decode, defaults vs staged zero-copy: 20b then 120b); fin7 (16-user serve with an FP8 KV cache, then with the defaults); fin6 (16 users in one process: early guesses at 16 sequences, hybrid with guesses at 4 / 16; then a 16-user serve with the defaults); admab (the cache's admission control off / on and early guesses at 16 sequences: 16-user closed loop in one process, 1-sequence decode, then a 16-user serve with the defaults); th2 (16-user serve --cpu-experts auto, kernel threads 12 then 15); thab (16-user serve with --cpu-experts auto: kernel threads 15 / 12 / passive OpenMP waits, and off); pbgab (GPU tests of the batched prefill path, the prefill stream and the warm-up; 120b 8k prefill with
#   FERRYMAN_PREFETCH_BEFORE_GROUPS=0 / 1); pbgab2 (120b 8k prefill in one process: defaults /
#   FERRYMAN_PREFETCH_BEFORE_GROUPS=0 / FERRYMAN_PREFETCH_SPLIT_BUSY=1, twice; then its profile); attnt (the GPU tests of paged attention, fp8 KV, the window
#   pool and segment graphs); fresh1 (fresh2's first serve alone); grp16ab (120b 8k prefill, groups of 8 / 16 experts, in
#   one process); diagdec120 (120b one-sequence decode profile with the copy /
#   kernel overlap and a timeline of about one token); narrowab (120b one-sequence decode, early guesses of 4 / 3 / 2
#   experts per token with gap and wrap guesses, then 4 with the slot ids on the copy stream: copied against needed bytes);
#   qwenfix (the batched-prefill GPU tests, skewed routing's peak included, then offloadqwen: session 16's
#   qwen3 run at 8 GiB ran out of memory in its 4k chunk); narrow20 / narrow120b / narrowqwen (one-sequence decode, the default adaptive copy width against a fixed
#   top-k and a fixed half: gpt-oss-20b at 8 GiB, gpt-oss-120b at 16 GiB (no fixed half), qwen3-30b-a3b at 8 GiB); upab (GPU tests of the prefill stream, offload identity, the
#   batched path and the hybrid; 120b 8k prefill with a layer's inputs on the copy stream / on the compute stream, one
#   process); off120 (offload120 with a longer limit); mxbits (the grouped-GEMM GPU tests, then bench_prefill_moe:
#   the prefill MoE paths by token count with the grouped kernel's MXFP4 tile decodes (bits, dot_scaled), and its tiles at 128 tokens); densepf (qwen3-30b-a3b at 8 GiB, 256- and 8192-token prefill:
#   the default (grouped GEMM for bf16 experts) against FERRYMAN_MOE_PREFILL=batched, one process); resident (gpt-oss-20b resident decode: bench_decode, then
#   bench_offload at 40 GiB, which plans every expert on the GPU); evenab (GPU tests of the prefill stream, offload identity and
#   the batched path; 120b 8k prefill, experts kept evenly over the layers / as the first chunks left them, one process);
#   fresh2 (the 16-user serve with an empty Triton cache, listing what compiled
#   during the load, then again on that cache); splitab (offload GPU tests with FERRYMAN_PREFETCH_SPLIT_BUSY=1, then 120b 8k prefill with / without it); warm2 (the 16-user serve twice, with the startup warm-up); fin14b (the 16-user serve with the final defaults, 120b 8k prefill, the serve again); fin14 (offload GPU tests, the 16-user serve with the defaults, 120b 8k prefill with / without FERRYMAN_PREFETCH_AVOID_BUSY, the serve again); gtw (the guess GPU tests: wrap, gap, offload identity, segment graphs, window pool, hybrid); s16d (the 16-user serve with the defaults); wrapab (16 users in one process and one-sequence decode, without / with wrap guesses); pre120 (120b 8k prefill profile: copies against kernels over time); winab (the window-pool GPU tests, 16-user serve with the window pool / without, 120b one-sequence decode with the defaults); wideab (one-sequence decode, early guesses of 4 / 6 / 8 experts per token: 20b and 120b); clab (the 16-user serve load in one process, no HTTP: hybrid off vs on, in turn); stageab (staged zero-copy: its GPU tests, the staging kernel's GB/s, then 20b decode default / zero-copy / staged, 120b staged); fin4 (bench bw, 16-user serve with the CLI defaults / the old ones / the defaults again, 120b one-sequence decode off / early / hybrid); hyb2 (bench bw, 20b decode and 16-user serve with --cpu-experts auto); sgtests (the segment-graph GPU tests); diagpre120 (120b prefill profile); moegab20 (moegab's 20b half); moegab (decode with the MoE kernels as graphs vs eager); uva (kernel reads of pinned host memory, and
#   one MoE layer reading its experts zero-copy vs copying them first); serve; serve4k (the same with
#   4096-token steps); serve120 (gpt-oss-120b at 16 GiB, 1-32 users).
#   Default: tests decode kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'

BIG_GROUPED="tests/test_grouped_moe.py::test_grouped_moe_on_cuda_gpt_oss_20b_layer[300]"

# SUITE_BUDGET (seconds, default 560): stages are cut short or skipped so the archive is always
# written before a `device run` limit kills the command.
SUITE_END=$(( $(date +%s) + ${SUITE_BUDGET:-560} - 20 ))
have() { [ $(( SUITE_END - $(date +%s) )) -ge "$1" ]; }  # have SECONDS: that much budget is left
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local left=$(( SUITE_END - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "=== $name skipped: the suite budget is spent"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "=== $name (limit ${secs}s): $*"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"; echo "=== $name rc=$rc"
}

serve16() {  # serve16 NAME PORT [env VAR=VALUE...] -- [serve flags...]: gpt-oss-20b at 8 GiB, 16 users only
  local name=$1 port=$2; shift 2
  local envs=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  have 100 || { echo "=== $name skipped: the suite budget is spent"; return; }
  env "${envs[@]}" python3 -m ferryman serve gpt-oss-20b --load-format dummy --gpu-memory 8GiB --max-model-len 1536 \
    --max-num-seqs 16 --port "$port" --log-level warning "$@" > "$OUT/${name}_server.log" 2>&1 &
  local srv=$!
  for _ in $(seq 1 120); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  # SNAP_CACHE=DIR (the server's TRITON_CACHE_DIR): what Triton compiled after the warm-up, i.e. during the load
  [ -n "${SNAP_CACHE:-}" ] && ls "$SNAP_CACHE" > "$OUT/${name}_cache_ready.txt" 2>/dev/null
  stage "$name" 120 python3 -m ferryman bench serve "http://127.0.0.1:$port" --concurrency 16 \
    --prompt-tokens 1024 --output-tokens 128 --json "$OUT/$name.json"
  if [ -n "${SNAP_CACHE:-}" ]; then
    mkdir -p "$OUT/${name}_compiled_in_load"
    for d in $(ls "$SNAP_CACHE" | grep -vxF -f "$OUT/${name}_cache_ready.txt"); do
      # the .ttir names the specialisation (tt.divisibility of each argument, the constexprs)
      for f in "$SNAP_CACHE/$d"/*.json "$SNAP_CACHE/$d"/*.ttir; do
        [ -f "$f" ] && cp "$f" "$OUT/${name}_compiled_in_load/${d:0:10}_$(basename "$f")"
      done
    done
    echo "compiled during the load: $(ls "$OUT/${name}_compiled_in_load" | grep -v __grp__ | grep '\.json$' | sed 's/^[^_]*_//' | sort | uniq -c | tr '\n' ' ')"
  fi
  curl -s "127.0.0.1:$port/v1/stats" > "$OUT/${name}_stats.json"
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
}

for s in "${@:-tests decode kernels}"; do
  for s1 in $s; do
    case "$s1" in
      tests)   stage gpu_tests 240 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 --durations=15 --deselect "$BIG_GROUPED" tests/ ;;
      gtests)  stage gpu_tests_offload 200 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_mxfp4.py tests/test_offload_identity.py tests/test_segment_graphs.py tests/test_hf_parity.py \
                 tests/test_prefill_stream.py tests/test_fused_moe.py tests/test_hybrid.py tests/test_calibration.py tests/test_batched_moe.py \
                 tests/test_host_embedding.py tests/test_kv_fp8.py ;;
      grouped) stage gpu_grouped 120 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 "$BIG_GROUPED" ;;
      decode)  stage decode 150 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy --tokens 256 \
                 --profile 64
               stage decode2 100 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy --tokens 256 ;;
      fusek)   stage decode_fusek 120 env FERRYMAN_MOE_DECODE_TILES=16,512,2,fma,fusek \
                 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy --tokens 256 ;;
      kernels) stage moe_kernel 90 python3 benchmarks/bench_fused_moe.py
               stage attention 60 python3 benchmarks/bench_attention.py ;;
      prefix)  stage prefix 150 python3 benchmarks/bench_prefix_cache.py --model gpt-oss-20b --load-format dummy \
                 --prefix-tokens 4096 --tail-tokens 128 ;;
      offload20)  stage offload20 150 python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --json "$OUT/offload20.json" ;;
      offload20pf) stage offload20pf 90 python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --decode-prefetch \
                 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/offload20pf.json" ;;
      prefillab) pre="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 4096"
               stage pre20_ref 100 $pre --target gpt-oss-20b:8GiB --json "$OUT/pre20_ref.json"
               stage pre20_batched 100 env FERRYMAN_MOE_PREFILL=batched $pre --target gpt-oss-20b:8GiB \
                 --json "$OUT/pre20_batched.json"
               stage pre20_batched8 100 env FERRYMAN_MOE_PREFILL=batched FERRYMAN_MOE_PREFILL_GROUP=8 $pre \
                 --target gpt-oss-20b:8GiB --json "$OUT/pre20_batched8.json"
               stage pre120_batched 150 env FERRYMAN_MOE_PREFILL=batched $pre --target gpt-oss-120b:16GiB \
                 --json "$OUT/pre120_batched.json" ;;
      late)    stage offload20late 90 python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --decode-prefetch late \
                 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/offload20late.json"
               stage offload120late 150 python3 benchmarks/bench_offload.py --target gpt-oss-120b:16GiB --decode-prefetch late \
                 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/offload120late.json" ;;
      offload120) stage offload120 200 python3 benchmarks/bench_offload.py --target gpt-oss-120b:16GiB --json "$OUT/offload120.json" ;;
      offloadqwen) stage offloadqwen 150 python3 benchmarks/bench_offload.py --target qwen3-30b-a3b:8GiB --json "$OUT/offloadqwen.json" ;;
      offloadab) ab="python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage ab_default 90 $ab --json "$OUT/ab_default.json"
               stage ab_eager 90 $ab --eager --json "$OUT/ab_eager.json"
               stage ab_noprefetch 90 $ab --no-prefetch --json "$OUT/ab_noprefetch.json"
               stage ab_bankmajor 90 $ab --bank-major --json "$OUT/ab_bankmajor.json"
               pre="python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --decode-tokens 8 --ttft-prompt 0"
               stage ab_prefill_ref 90 $pre --json "$OUT/ab_prefill_ref.json"
               stage ab_prefill_grouped 90 env FERRYMAN_MOE_PREFILL=grouped $pre --json "$OUT/ab_prefill_grouped.json"
               stage ab_resident 90 python3 benchmarks/bench_offload.py --target gpt-oss-20b:40GiB --decode-tokens 256 \
                 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/ab_resident.json"
               stage ab_chunk4096 90 $pre --ttft-prompt 4096 --chunk 4096 --decode-tokens 64 --json "$OUT/ab_chunk4096.json"
               q="python3 benchmarks/bench_offload.py --target qwen3-30b-a3b:8GiB --decode-tokens 64 --ttft-prompt 0 --prefill-prompt 0"
               stage ab_qwen 90 $q --json "$OUT/ab_qwen.json"
               stage ab_qwen_hybrid 90 $q --cpu-experts auto --json "$OUT/ab_qwen_hybrid.json" ;;
      uva)     stage uva 60 python3 benchmarks/bench_uva.py
               stage zero_copy 60 python3 benchmarks/bench_zero_copy_moe.py
               stage zero_copy_120b 90 python3 benchmarks/bench_zero_copy_moe.py --model gpt-oss-120b ;;
      diag)    stage diag 200 python3 tools/diag_offload.py --tokens 48 --prefill 4096 ;;
      diagpre) d="python3 tools/diag_offload.py --tokens 0 --prefill 4096"
               stage diagpre20_ref 100 $d
               stage diagpre20_b4 100 env FERRYMAN_MOE_PREFILL=batched $d
               stage diagpre20_b16 100 env FERRYMAN_MOE_PREFILL=batched FERRYMAN_MOE_PREFILL_GROUP=16 $d
               stage diagpre120_b4 150 env FERRYMAN_MOE_PREFILL=batched $d --model gpt-oss-120b --budget 16GiB ;;
      lookab)  pre="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 4096 --target gpt-oss-120b:16GiB"
               stage look120_1 150 env FERRYMAN_PREFILL_LOOKAHEAD=1 $pre --json "$OUT/look120_1.json"
               stage look120_2 150 env FERRYMAN_PREFILL_LOOKAHEAD=2 $pre --json "$OUT/look120_2.json" ;;
      lateab)  d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage late20_off 90 $d --target gpt-oss-20b:8GiB --json "$OUT/late20_off.json"
               stage late20_on 90 $d --target gpt-oss-20b:8GiB --decode-prefetch late --json "$OUT/late20_on.json"
               stage late120_off 120 $d --target gpt-oss-120b:16GiB --json "$OUT/late120_off.json"
               stage late120_on 120 $d --target gpt-oss-120b:16GiB --decode-prefetch late --json "$OUT/late120_on.json" ;;
      moegab)  d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage moeg20_off 90 env FERRYMAN_MOE_GRAPHS=0 $d --target gpt-oss-20b:8GiB --json "$OUT/moeg20_off.json"
               stage moeg20_on 90 $d --target gpt-oss-20b:8GiB --json "$OUT/moeg20_on.json"
               stage moeg120_off 120 env FERRYMAN_MOE_GRAPHS=0 $d --target gpt-oss-120b:16GiB --json "$OUT/moeg120_off.json"
               stage moeg120_on 120 $d --target gpt-oss-120b:16GiB --json "$OUT/moeg120_on.json" ;;
      expab)   d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 4096 --prefill-prompt 0 --target gpt-oss-20b:8GiB"
               stage exp20_off 90 $d --json "$OUT/exp20_off.json"
               stage exp20_on 90 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $d --json "$OUT/exp20_on.json" ;;
      moegab20) d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 --target gpt-oss-20b:8GiB"
               stage moeg20_off 90 env FERRYMAN_MOE_GRAPHS=0 $d --json "$OUT/moeg20_off.json"
               stage moeg20_on 90 $d --json "$OUT/moeg20_on.json" ;;
      ltests)  stage gpu_tests_late 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_segment_graphs.py tests/test_expert_cache.py tests/test_planner.py tests/test_offload_identity.py ;;
      late2ab) d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage l2_20_off 80 $d --target gpt-oss-20b:8GiB --json "$OUT/l2_20_off.json"
               stage l2_20_late 80 env FERRYMAN_DECODE_PREFETCH=late $d --target gpt-oss-20b:8GiB --json "$OUT/l2_20_late.json"
               stage l2_20_late2 80 env FERRYMAN_DECODE_PREFETCH=late2 $d --target gpt-oss-20b:8GiB --json "$OUT/l2_20_late2.json"
               stage l2_120_off 110 $d --target gpt-oss-120b:16GiB --json "$OUT/l2_120_off.json"
               stage l2_120_late2 110 env FERRYMAN_DECODE_PREFETCH=late2 $d --target gpt-oss-120b:16GiB --json "$OUT/l2_120_late2.json" ;;
      late2ab20) d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 --target gpt-oss-20b:8GiB"
               stage m20_off 80 $d --json "$OUT/m20_off.json"
               stage m20_late 80 env FERRYMAN_DECODE_PREFETCH=late $d --json "$OUT/m20_late.json"
               stage m20_late2 80 env FERRYMAN_DECODE_PREFETCH=late2 $d --json "$OUT/m20_late2.json" ;;
      sgtests) stage gpu_tests_segments 100 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_segment_graphs.py ;;
      diagpre120) stage diagpre120 200 python3 tools/diag_offload.py --tokens 0 --prefill 4096 --model gpt-oss-120b --budget 16GiB ;;
      pakab)   stage pak120 150 python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 4096 \
                 --target gpt-oss-120b:16GiB --json "$OUT/pak120.json"
               stage pak20_on 100 python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --json "$OUT/pak20_on.json"
               stage pak20_off 100 env FERRYMAN_PREFETCH_AFTER_KERNELS=0 python3 benchmarks/bench_offload.py \
                 --target gpt-oss-20b:8GiB --json "$OUT/pak20_off.json" ;;
      pak120ab) p="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 0 --target gpt-oss-120b:16GiB"
               stage pak120_off 110 env FERRYMAN_PREFETCH_AFTER_KERNELS=0 $p --json "$OUT/pak120_off.json"
               stage pak120_on 110 $p --json "$OUT/pak120_on.json" ;;
      serveab) serve16 s16_default 8131 --
               serve16 s16_late 8132 FERRYMAN_DECODE_PREFETCH=late --
               serve16 s16_late2 8133 FERRYMAN_DECODE_PREFETCH=late2 --
               serve16 s16_fp8 8134 -- --kv-cache-dtype fp8
               serve16 s16_late_fp8 8135 FERRYMAN_DECODE_PREFETCH=late -- --kv-cache-dtype fp8 ;;
      hyb)     stage hyb_cpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/test_mxfp4_cpu.py
               stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage h20_off 80 $d --target gpt-oss-20b:8GiB --json "$OUT/h20_off.json"
               stage h20_auto 80 $d --target gpt-oss-20b:8GiB --cpu-experts auto --json "$OUT/h20_auto.json"
               serve16 s16_hyb 8136 -- --cpu-experts auto
               serve16 s16_default 8137 --
               stage h120_auto 120 $d --target gpt-oss-120b:16GiB --cpu-experts auto --json "$OUT/h120_auto.json" ;;
      hyb2)    stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               stage h20_auto 80 python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 \
                 --target gpt-oss-20b:8GiB --cpu-experts auto --json "$OUT/h20_auto.json"
               serve16 s16_hyb 8136 -- --cpu-experts auto ;;
      hyb3)    stage cpu_mxfp4 60 python3 benchmarks/bench_cpu_mxfp4.py --tokens 1,2,3,4,8 --threads 0,15
               stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               serve16 s16_hyb 8136 -- --cpu-experts auto
               serve16 s16_default 8137 --
               serve16 s16_hyb_b 8138 -- --cpu-experts auto
               stage h20_auto 80 python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 \
                 --target gpt-oss-20b:8GiB --cpu-experts auto --json "$OUT/h20_auto.json" ;;
      bd16)    stage cpu_mxfp4 60 python3 benchmarks/bench_cpu_mxfp4.py --tokens 1,2,4 --threads 0
               stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               stage bd16 240 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 16 \
                 --modes off,early,cpu,early+cpu --reps 2 --json "$OUT/bd16.json" ;;
      ab3)     stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               bd="python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB"
               stage bd16 150 $bd --seqs 16 --modes off,cpu,early+cpu --reps 2 --json "$OUT/bd16.json"
               stage bd4 100 $bd --seqs 4 --modes off,cpu,early+cpu --reps 2 --json "$OUT/bd4.json"
               stage bd1 90 $bd --seqs 1 --tokens 128 --modes off,early,cpu,early+cpu --reps 2 --json "$OUT/bd1.json"
               serve16 s16_default 8137 --
               serve16 s16_hyb_early 8138 FERRYMAN_DECODE_PREFETCH=early -- --cpu-experts auto ;;
      fin4)    stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               serve16 s16_new 8141 --
               serve16 s16_old 8142 FERRYMAN_DECODE_PREFETCH=off -- --cpu-experts off
               serve16 s16_new_b 8143 --
               stage bd120 150 python3 benchmarks/bench_batch_decode.py --target gpt-oss-120b:16GiB --seqs 1 \
                 --tokens 96 --max-model-len 16384 --modes off,early,cpu,early+cpu --reps 1 --json "$OUT/bd120.json" ;;
      fin5)    serve16 s16_new 8151 --
               serve16 s16_old 8152 FERRYMAN_DECODE_PREFETCH=off -- --cpu-experts off ;;
      thab)    stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               serve16 s16_auto 8161 -- --cpu-experts auto
               serve16 s16_auto_t12 8162 FERRYMAN_CPU_THREADS=12 -- --cpu-experts auto
               serve16 s16_auto_passive 8163 OMP_WAIT_POLICY=passive -- --cpu-experts auto
               serve16 s16_off 8164 -- ;;
      admab)   stage ad16 330 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 16 --prompt 1024 \
                 --tokens 128 --closed-loop 2 --modes off+noadm,off,early@16 --reps 2 --json "$OUT/ad16.json"
               stage ad1 90 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 1 --tokens 128 \
                 --modes early+noadm,early --reps 2 --json "$OUT/ad1.json"
               serve16 s16_adm 8165 -- ;;
      fin6)    stage cl6 240 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 16 --prompt 1024 \
                 --tokens 128 --closed-loop 2 --modes early@16,early+cpu,early@16+cpu --reps 1 --json "$OUT/cl6.json"
               serve16 s16_fin6 8166 -- ;;
      fin7)    serve16 s16_fp8 8167 -- --kv-cache-dtype fp8
               serve16 s16_fin7 8168 -- ;;
      st2)     d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage st20_default 70 $d --target gpt-oss-20b:8GiB --json "$OUT/st20_default.json"
               stage st20_staged 70 env FERRYMAN_ZERO_COPY=1 FERRYMAN_ZERO_COPY_STAGE=4 $d --target gpt-oss-20b:8GiB \
                 --json "$OUT/st20_staged.json"
               stage st120_default 90 $d --target gpt-oss-120b:16GiB --json "$OUT/st120_default.json"
               stage st120_staged 90 env FERRYMAN_ZERO_COPY=1 FERRYMAN_ZERO_COPY_STAGE=4 $d --target gpt-oss-120b:16GiB \
                 --json "$OUT/st120_staged.json" ;;
      gapab)   stage gap_tests 90 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=60 tests/test_gap_guess.py
               bd="python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128"
               stage gap20 120 $bd --target gpt-oss-20b:8GiB --modes early,early+gap,early+gap2 --reps 2 --json "$OUT/gap20.json"
               stage gap120 200 $bd --target gpt-oss-120b:16GiB --max-model-len 16384 --modes early,early+gap \
                 --reps 2 --json "$OUT/gap120.json" ;;
      winab)   stage gpu_tests_window 200 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_window_pool.py tests/test_hf_parity.py tests/test_offload_identity.py tests/test_segment_graphs.py \
                 tests/test_kv_fp8.py tests/test_prefill_stream.py tests/test_host_embedding.py tests/test_hybrid.py
               serve16 s16_window 8171 --
               serve16 s16_nowindow 8172 FERRYMAN_WINDOW_KV=0 --
               stage dec120 200 python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 \
                 --target gpt-oss-120b:16GiB --json "$OUT/dec120.json" ;;
      fin14)   stage gpu_tests_fin 120 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_offload_identity.py tests/test_prefill_stream.py tests/test_wrap_guess.py tests/test_expert_cache.py
               serve16 s16_fin 8191 --
               p="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 0 --prefill-prompt 8192 --target gpt-oss-120b:16GiB"
               stage pre120_avoid 130 $p --json "$OUT/pre120_avoid.json"
               stage pre120_noavoid 130 env FERRYMAN_PREFETCH_AVOID_BUSY=0 $p --json "$OUT/pre120_noavoid.json"
               serve16 s16_fin2 8192 -- ;;
      fin14b)  serve16 s16_final1 8193 --
               stage pre120_final 130 python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 0 --prefill-prompt 8192 \
                 --target gpt-oss-120b:16GiB --json "$OUT/pre120_final.json"
               serve16 s16_final2 8194 -- ;;
      splitab) stage gpu_tests_split 150 env FERRYMAN_PREFETCH_SPLIT_BUSY=1 python3 -m pytest -v -m gpu -p no:cacheprovider \
                 -o faulthandler_timeout=90 tests/test_offload_identity.py tests/test_prefill_stream.py
               p="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 0 --prefill-prompt 8192 --target gpt-oss-120b:16GiB"
               stage pre120_split 130 env FERRYMAN_PREFETCH_SPLIT_BUSY=1 $p --json "$OUT/pre120_split.json"
               stage pre120_nosplit 130 $p --json "$OUT/pre120_nosplit.json" ;;
      pbgab)   stage gpu_tests_pbg 200 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_batched_moe.py tests/test_prefill_stream.py tests/test_offload_identity.py tests/test_warm_up.py
               p="python3 benchmarks/bench_offload.py --decode-tokens 8 --ttft-prompt 0 --prefill-prompt 8192 --target gpt-oss-120b:16GiB"
               stage pre120_pbg0 130 env FERRYMAN_PREFETCH_BEFORE_GROUPS=0 $p --json "$OUT/pre120_pbg0.json"
               stage pre120_pbg1 130 $p --json "$OUT/pre120_pbg1.json" ;;
      pbgab2)  stage pre120_ab 200 python3 benchmarks/bench_prefill_ab.py --target gpt-oss-120b:16GiB --prompt 8192 \
                 --variant "" --variant FERRYMAN_PREFETCH_BEFORE_GROUPS=0 --variant FERRYMAN_PREFETCH_SPLIT_BUSY=1 --reps 2 \
                 --json "$OUT/pre120_ab.json"
               stage diagpre120 170 python3 tools/diag_offload.py --tokens 0 --prefill 8192 --model gpt-oss-120b --budget 16GiB ;;
      attnt)   stage gpu_tests_attn 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_paged_attention.py tests/test_kv_fp8.py tests/test_window_pool.py tests/test_segment_graphs.py ;;
      fresh1)  SNAP_CACHE=/tmp/triton_fresh1 serve16 s16_fresh1 8199 TRITON_CACHE_DIR=/tmp/triton_fresh1 -- ;;
      grp16ab) stage pre120_grp 150 python3 benchmarks/bench_prefill_ab.py --target gpt-oss-120b:16GiB --prompt 8192 \
                 --variant "" --variant FERRYMAN_MOE_PREFILL_GROUP=16 --reps 2 --json "$OUT/pre120_grp.json" ;;
      evenab)  stage gpu_tests_even 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_prefill_stream.py tests/test_offload_identity.py tests/test_batched_moe.py
               stage pre120_even 150 python3 benchmarks/bench_prefill_ab.py --target gpt-oss-120b:16GiB --prompt 8192 \
                 --variant "" --variant FERRYMAN_STREAM_EVEN=0 --settle 1 --reps 2 --json "$OUT/pre120_even.json" ;;
      upab)    stage gpu_tests_up 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_prefill_stream.py tests/test_offload_identity.py tests/test_batched_moe.py tests/test_hybrid.py
               stage pre120_up 130 python3 benchmarks/bench_prefill_ab.py --target gpt-oss-120b:16GiB --prompt 8192 \
                 --variant "" --variant FERRYMAN_INPUTS_ON_COPY_STREAM=0 --reps 2 --json "$OUT/pre120_up.json" ;;
      resident) stage resident_decode 150 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy --tokens 256
               stage resident_offload 150 python3 benchmarks/bench_offload.py --target gpt-oss-20b:40GiB --decode-tokens 256 \
                 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/resident_offload.json" ;;
      densepf) stage qwen_prefill_ab 200 python3 benchmarks/bench_prefill_ab.py --target qwen3-30b-a3b:8GiB --prompt 256,8192 \
                 --variant "" --variant FERRYMAN_MOE_PREFILL=batched --reps 2 --max-model-len 16384 --json "$OUT/qwen_prefill_ab.json" ;;
      mxbits)  stage gpu_tests_grouped 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_grouped_moe.py
               stage prefill_moe 240 python3 benchmarks/bench_prefill_moe.py --sweep 128 ;;
      off120)  stage offload120 170 python3 benchmarks/bench_offload.py --target gpt-oss-120b:16GiB --json "$OUT/offload120.json" ;;
      diagdec120) stage diagdec120 200 python3 tools/diag_offload.py --tokens 48 --prefill 0 --model gpt-oss-120b \
                 --budget 16GiB ;;
      narrowab) bd="python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128"
               stage narrow120 240 $bd --target gpt-oss-120b:16GiB --max-model-len 16384 \
                 --modes early+gap+wrap,early3+gap+wrap,early2+gap+wrap,early+gap+wrap+inputs --reps 2 \
                 --json "$OUT/narrow120.json" ;;
      qwenfix) stage gpu_tests_batched 120 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_batched_moe.py tests/test_prefill_stream.py
               stage offloadqwen 170 python3 benchmarks/bench_offload.py --target qwen3-30b-a3b:8GiB --json "$OUT/offloadqwen.json" ;;
      narrow20) stage narrow20 150 python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128 --target gpt-oss-20b:8GiB \
                 --modes early+gap+wrap,early4+gap+wrap,early2+gap+wrap --reps 2 --json "$OUT/narrow20.json" ;;
      narrow120b) stage narrow120b 200 python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128 \
                 --target gpt-oss-120b:16GiB --max-model-len 16384 --modes early+gap+wrap,early4+gap+wrap --reps 2 \
                 --json "$OUT/narrow120b.json" ;;
      narrowqwen) stage narrowqwen 200 python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128 \
                 --target qwen3-30b-a3b:8GiB --modes early+gap+wrap,early8+gap+wrap,early4+gap+wrap --reps 2 \
                 --json "$OUT/narrowqwen.json" ;;
      fresh2)  SNAP_CACHE=/tmp/triton_fresh serve16 s16_fresh 8197 TRITON_CACHE_DIR=/tmp/triton_fresh --
               serve16 s16_again 8198 TRITON_CACHE_DIR=/tmp/triton_fresh -- ;;
      warm2)   serve16 s16_warm1 8195 --
               serve16 s16_warm2 8196 -- ;;
      gtw)     stage gpu_tests_guess 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_wrap_guess.py tests/test_gap_guess.py tests/test_offload_identity.py tests/test_segment_graphs.py \
                 tests/test_window_pool.py tests/test_hybrid.py ;;
      s16d)    serve16 s16_default 8181 -- ;;
      wrapab)  bd="python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB"
               stage wrap16 260 $bd --seqs 16 --prompt 1024 --tokens 128 --closed-loop 2 --modes early+gap,early+gap+wrap \
                 --reps 2 --json "$OUT/wrap16.json"
               stage wrap1 120 $bd --seqs 1 --tokens 128 --modes early+gap,early+gap+wrap --reps 2 --json "$OUT/wrap1.json" ;;
      pre120)  stage diagpre120 220 python3 tools/diag_offload.py --tokens 0 --prefill 8192 --model gpt-oss-120b --budget 16GiB ;;
      th2)     serve16 s16_auto_t12 8162 FERRYMAN_CPU_THREADS=12 -- --cpu-experts auto
               serve16 s16_auto 8161 -- --cpu-experts auto ;;
      wideab)  bd="python3 benchmarks/bench_batch_decode.py --seqs 1 --tokens 128"
               stage wide20 120 $bd --target gpt-oss-20b:8GiB --modes off,early,early6,early8 --reps 2 --json "$OUT/wide20.json"
               stage wide120 200 $bd --target gpt-oss-120b:16GiB --max-model-len 16384 --modes early,early6,early8 \
                 --reps 2 --json "$OUT/wide120.json" ;;
      clab)    stage bw20 120 python3 -m ferryman bench bw gpt-oss-20b --reps 5
               stage cl16 300 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB --seqs 16 --prompt 1024 \
                 --tokens 128 --closed-loop 2 --modes off,cpu --reps 2 --json "$OUT/cl16.json" ;;
      stageab) stage gpu_tests_staging 120 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_staging.py tests/test_zero_copy.py
               stage uva 60 python3 benchmarks/bench_uva.py --mib 512
               d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0"
               stage st20_default 90 $d --target gpt-oss-20b:8GiB --json "$OUT/st20_default.json"
               stage st20_zc 90 env FERRYMAN_ZERO_COPY=1 $d --target gpt-oss-20b:8GiB --json "$OUT/st20_zc.json"
               stage st20_staged 90 env FERRYMAN_ZERO_COPY=1 FERRYMAN_ZERO_COPY_STAGE=4 $d --target gpt-oss-20b:8GiB \
                 --json "$OUT/st20_staged.json"
               stage st120_staged 150 env FERRYMAN_ZERO_COPY=1 FERRYMAN_ZERO_COPY_STAGE=4 $d --target gpt-oss-120b:16GiB \
                 --json "$OUT/st120_staged.json" ;;
      hybt)    stage hyb_tests 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_hybrid.py tests/test_calibration.py tests/test_segment_graphs.py ;;
      embab)   d="python3 benchmarks/bench_offload.py --decode-tokens 128 --ttft-prompt 4096 --prefill-prompt 0 --target gpt-oss-20b:8GiB"
               stage emb20_device 90 env FERRYMAN_HOST_EMBEDDING=0 $d --json "$OUT/emb20_device.json"
               stage emb20_host 90 $d --json "$OUT/emb20_host.json" ;;
      dequant) stage dequant 60 python3 benchmarks/bench_dequant.py ;;
      qtests)  stage gpu_tests_prefill 150 python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90 \
                 tests/test_mxfp4.py tests/test_batched_moe.py tests/test_fused_moe.py tests/test_prefill_stream.py ;;
      hybrid)  stage gpu_hybrid 90 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_hybrid.py tests/test_calibration.py ;;
      offload) stage offload 420 python3 benchmarks/bench_offload.py --json "$OUT/offload.json" ;;
      serve)   have 90 || { echo "=== serve skipped: the suite budget is spent"; continue; }
               python3 -m ferryman serve gpt-oss-20b --load-format dummy --gpu-memory 8GiB --max-model-len 1536 \
                 --max-num-seqs 16 --port 8123 --log-level warning > "$OUT/serve_server.log" 2>&1 &
               srv=$!
               for _ in $(seq 1 120); do curl -sf 127.0.0.1:8123/health >/dev/null && break; sleep 1; done
               stage serve 240 python3 -m ferryman bench serve http://127.0.0.1:8123 --concurrency 1,4,16 \
                 --prompt-tokens 1024 --output-tokens 128 --json "$OUT/serve.json"
               curl -s 127.0.0.1:8123/v1/stats > "$OUT/serve_stats.json"
               kill "$srv" 2>/dev/null ;;
      serve4k) have 90 || { echo "=== serve4k skipped: the suite budget is spent"; continue; }
               python3 -m ferryman serve gpt-oss-20b --load-format dummy --gpu-memory 8GiB --max-model-len 1536 \
                 --max-num-seqs 16 --max-num-batched-tokens 4096 --port 8125 --log-level warning > "$OUT/serve4k_server.log" 2>&1 &
               srv=$!
               for _ in $(seq 1 120); do curl -sf 127.0.0.1:8125/health >/dev/null && break; sleep 1; done
               stage serve4k 240 python3 -m ferryman bench serve http://127.0.0.1:8125 --concurrency 1,4,16 \
                 --prompt-tokens 1024 --output-tokens 128 --json "$OUT/serve4k.json"
               kill "$srv" 2>/dev/null ;;
      serve120) have 90 || { echo "=== serve120 skipped: the suite budget is spent"; continue; }
               python3 -m ferryman serve gpt-oss-120b --load-format dummy --gpu-memory 16GiB --max-model-len 1536 \
                 --max-num-seqs 32 --port 8124 --log-level warning > "$OUT/serve120_server.log" 2>&1 &
               srv=$!
               for _ in $(seq 1 240); do curl -sf 127.0.0.1:8124/health >/dev/null && break; sleep 1; done
               stage serve120 "${SERVE120_LIMIT:-420}" python3 -m ferryman bench serve http://127.0.0.1:8124 --concurrency "${SERVE120_LEVELS:-1,2,4,8,16,32}" \
                 --prompt-tokens 1024 --output-tokens 256 --requests-per-level 0 --json "$OUT/serve120.json"
               kill "$srv" 2>/dev/null ;;
      *) echo "unknown stage $s1: the stages are listed at the top of $0"; exit 2 ;;
    esac
  done
done
# The device tool returns at most 8 files from $OUT: pack everything into one archive.
( cd "$OUT" && files=$(ls -A | grep -v '^suite.tgz$') && [ -n "$files" ] && tar czf suite.tgz $files && rm -rf $files )
echo "=== logs and JSON: $OUT/suite.tgz"
