#!/usr/bin/env bash
# What ferryman checks on the GPU machine, in stages, each with its own time limit. Logs and JSON go
# to $OUT (default ./gpu-out) and are packed into $OUT/suite.tgz at the end (the device tool returns
# few files). A device call lasts 10 minutes at most: SUITE_BUDGET (seconds, default 560) cuts the
# last stages short so that the archive is always written.
#
#   tools/fetch_device_wheels.sh        # here, once: the server stages need fastapi/uvicorn/... in .whl/
#   device run --carry .whl: tools/gpu_suite.sh tests                        # ~4 min
#   device run --carry .whl: tools/gpu_suite.sh "resident offload20 serve16"
#   # before/after on one machine: the older tree in .old/ (git-ignored, small without the demo model)
#   git archive --prefix=.old/ <rev> ferryman benchmarks ':(exclude)ferryman/assets/demo-moe' | tar -x
#   device run --carry .whl --carry .old: OLD=.old tools/gpu_suite.sh compare
#
# Stages (default: tests):
#   tests        the GPU tests (pytest -m gpu), but the 300-token grouped-kernel test
#   grouped      that test alone
#   resident     gpt-oss-20b resident decode (bench_decode), then bench_offload at 40 GiB, which plans
#                every expert on the GPU
#   offload20    gpt-oss-20b at 8 GiB (bench_offload): link, decode tok/s, TTFT of a 4k prompt, 8k prefill
#   offload120   gpt-oss-120b at 16 GiB, the same figures
#   spread20     gpt-oss-20b at 8 GiB, one-sequence decode six times: the main thread free, then pinned to CPU
#                MAIN_CPU (default 3), alternated (decode_host: where the host time of slow runs goes)
#   prof16k      a 16k-token prompt of gpt-oss-20b at 8 GiB under the profiler: the compute stream's gaps, then
#                the host's Python functions by own time (profile_prefill.py --gaps --python)
#   profdecode   one sequence's decode steps under the profiler (benchmarks/profile_decode.py --gaps): qwen3-30b-a3b
#                int4 at 8 GiB (link steps: what holds them at 0.2 of the link limit, issue 21) and gpt-oss-20b
#                at 8 GiB (the copy path: the host's share of a step, issue 22); ~3 min
#   decodehost   the expert bookkeeping of one offloaded decode layer on this machine's host, the routing read's
#                sync included (bench_decode_host.py --device cuda): gpt-oss-20b and qwen3-30b-a3b int4, beside
#                the host's speed probe (the dev VM's figures: docs/benchmarks.md); ~1 min
#   threadteams  one layer of CPU experts on the main thread and on a second one (bench_thread_teams.py):
#                gpt-oss-20b's MXFP4 layer and the demo model's; whether OpenMP's thread teams slow the hybrid
#                split's worker thread on this machine's cores; ~2 min
#   tail20       gpt-oss-20b at 8 GiB in process: TTFT of 4,096 and 4,170-token prompts, each twice
#                (profile_prefill.py), the last under the profiler (--gaps): what a 74-token last chunk
#                costs a layer-major prompt; then the same with 4,352-token chunks (4,170 tokens in one
#                chunk); ~2 min
#   offloadqwen  qwen3-30b-a3b at 8 GiB, the same figures
#   quant        the FP8 / NVFP4 kernel GPU tests, then qwen3-30b-a3b at 8 GiB with dummy experts in bf16, fp8
#                and nvfp4 (QUANTS, default "none fp8 nvfp4"): decode at 1 user, TTFT of a 4k prompt, the link
#                limits (decode_vs_link, decode_vs_needed); about 4 minutes (QUANTS="fp8 nvfp4" in a second
#                call if the budget runs out)
#   int4         the int4/int8 kernel GPU tests (tests/test_intq*.py), then qwen3-30b-a3b at 8 GiB with dummy int4
#                experts (groups of 128): decode at 1 user, TTFT of a 4k prompt, link limits (beside the quant
#                stage's bf16 / fp8 / nvfp4 rows; QUANTS=int4 runs it there too); about 3 minutes
#   int4oss      gpt-oss-120b at 16 GiB with int4 experts in groups of 32 (2880 is no multiple of 128): decode,
#                beside offload120's MXFP4 figure; about 3 minutes
#   linktrial    decode_misses auto with its link reads on trial against copies (experts/split_trial.py):
#                gpt-oss-120b int4-g32 at 16 GiB (link lost there, 13.9 against 23.0 tok/s) and qwen3-30b-a3b
#                int4 at 8 GiB (link won), 160 tokens decoded first so that the trial rules; ~5 min
#   serve16      `ferryman serve gpt-oss-20b` at 8 GiB (16 sequences, 1536 tokens), then `ferryman bench
#                serve` with 16 users, 1024 prompt / 128 output tokens
#   split        `ferryman serve gpt-oss-20b` at 8 GiB for 32 sequences of 8192 tokens (KV and expert slots
#                share the budget, engine/memory_split.py): `ferryman plan`'s predictions, `ferryman bench
#                serve` at 1, 4 and 32 users (1024 in / 128 out), one 7,900-token conversation, `ferryman
#                ctl`, then bench_split.py: predictions beside the measurement and the targets (~2.5 min);
#                then gpt-oss-120b at 16 GiB, same server flags, 1, 2, 4, 8, 16 and 32 users, one request
#                each (~3 min, its dummy weights take 1-2 of them; on 2026-12-01 its 1-16 user levels took
#                more than 200 s, so its bench gets 400 s: ~8 min, a call of its own); split20 and split120
#                run one each
#   longprompt   `ferryman serve` with default settings (layer-major prefill): gpt-oss-20b at 8 GiB, TTFT at
#                4,170 / 16k / 32k tokens and the token gap of a decoding user while a 32k prompt is
#                prefilled (benchmarks/bench_long_prompt.py); then gpt-oss-120b at 16 GiB, TTFT at 32k
#                (its dummy weights take 1-2 minutes to build: ~5 minutes in all); longprompt20 and
#                longprompt120 run one each
#   prefix       TTFT with and without a cached 4k prefix (bench_prefix_cache, gpt-oss-20b)
#   kernels      the MoE and attention kernel benchmarks
#   prefillattn  a 16k and a 32k prompt's full-attention prefill in 4096-token chunks: the paged Triton
#                kernel against torch's flash and cuDNN attention with the sinks merged by log-sum-exp
#                (benchmarks/bench_prefill_attention.py; issue 25's lever); ~1 min
#   groupedq     the grouped GEMM's packed-tile GPU tests (int4/int8, fp8, nvfp4 at qwen3-30b-a3b and
#                qwen3-next shapes), then bench_prefill_moe: grouped vs batched by token count for qwen3-30b-a3b
#                in bf16, int4, fp8, nvfp4 and qwen3-next in int4, fp8, nvfp4 (sets layers/fused_moe.py's
#                GROUPED_*_MAX_PAIRS), and the batched path alone for Q4_K_M at both shapes (GGUF experts
#                take it at every size: the grouped GEMM does not read them); ~5 min
#   gguf         the GGUF kernel tests (dequantiser, decode GEMVs, batched prefill), then the decode
#                GEMV on a qwen3-30b-a3b layer: Q4_K, Q4_K_M's Q4_K + Q6_K, and MXFP4 (~2.5 min)
#   families     bench_offload at 16 GiB on the first layers of glm-4.5-air (12), qwen3-next-80b-a3b (12)
#                and deepseek-v3 (5: 3 dense, 2 MoE): bf16 experts of 45-68 GiB do not fit the host
#                RAM whole; decode time per layer compares with offload120's; deepseek-v3 also prefills a
#                4096-token prompt (MLA's expanded prefill: its prefill tok/s and peak_gib); FAMILIES picks
#                some (default "glm-4.5-air:12:0 qwen3-next-80b-a3b:12:0 deepseek-v3:5:4096": preset:layers:prefill)
#   hybridprefix an agent's second turn on qwen3-next-80b-a3b (12 layers, 16 GiB): 8k context, then a
#                200-token turn, restored from a state checkpoint, against the same prompt cold
#   hybridsteps  the state-checkpoint GPU tests (fla in segment rounds, saves inside a chunk in bf16), then
#                the cached turn's engine steps on qwen3-next-80b-a3b (12 layers, int4, 16 GiB: 8,192 tokens,
#                then 200 more; one prefill step expected, it was 208 + 8 tokens); ~3 min
#   strategies   the CPU kernel's tests on this CPU (AVX512-BF16 runs only here), one core's
#                microseconds per matrix at 1-32 tokens (bench_cpu_mxfp4.py --matrix), then
#                `ferryman bench bw gpt-oss-20b --json` (each CPU kernel's GB/s beside the host read
#                bandwidth), then gpt-oss-20b at 8 GiB with moe_strategy offload and hybrid: one
#                sequence's decode tok/s and the TTFT of a 4k prompt (bench_offload); ~5 min
#   bf16isa      one core's microseconds per matrix at 1-8 tokens with AVX512-BF16 (vdpbf16ps for bf16) and
#                without (bf16 widened by a shift, then FMA, as fp16 is converted): which bf16 path to take
#                at few tokens (issue 23's bf16 target); ~1 min
#   strategies2  the same with layers (N filling the budget), auto and cpu; ~5 min
#   cpupacked    the CPU kernel's tests on this CPU (packed formats, MXFP4 and dense; AVX512-BF16 runs only
#                here), then `ferryman bench bw --reps 10 --json` for qwen3-30b-a3b and gpt-oss-20b: each
#                kernel's GB/s beside the host read bandwidth (issue 23's shares; three repetitions gave an
#                MXFP4 outlier on 2026-12-02); ~4 min
#   strategies8  offload, hybrid, layers and auto decoding 8 sequences together (bench_batch_decode); ~4 min
#   ggufqwen     a random-weight qwen3-30b-a3b GGUF in llama.cpp's Q4_K_M mix (tools/gguf_random.py, ~17 GiB
#                in $GGUF_DIR, default /tmp; kept for the next stages while the machine stays warm), then
#                bench_offload on it at 8 GiB: decode at 1 user, TTFT of a 4k prompt, link bytes per token
#   ggufoss      gpt-oss-20b from its folder against the GGUF llama.cpp's own converter makes of it (MXFP4
#                experts): the peer kit's ($PEER_KIT, default .peer-kit) gen_gptoss.py writes the random
#                checkpoint (13.8 GB, ~25 s), gen_gguf.py converts it with the kit's llama.cpp source (no
#                build; ~95 s; both in $GGUF_DIR, default /tmp, kept while the machine stays warm), then
#                bench_gguf_vs_folder.py: bench_offload at 8 GiB (offload, 128 decode tokens, TTFT of a 4k
#                prompt) on folder, GGUF, folder, GGUF, and the GGUF / folder ratios (target: within 5%); ~6 min
#   llamacpp_build  llama.cpp from the peer kit ($PEER_KIT, default .peer-kit: copy /work/shared/peer-kit
#                there, without its wheels/, and carry it), ~6 min: a call of its own
#   llamacpp_prep   llama.cpp's build in the background while ggufqwen's file is written: both in ~5.5 min
#                (2026-12-01: file 167 s, build 315 s), then ggufqwen's bench_offload if the budget allows
#   llamacpp     on the ggufqwen stage's file, one client for both (the peer kit's bench_client.py: 512 and
#                4096-token prompts, 128 tokens; load_client.py: 16 users, 1024 in / 128 out; both with
#                tools/peer_client.py's fixes) against llama-server (-ngl 99, --n-cpu-moe NCPUMOE1, default
#                31, for 1 user and NCPUMOE16, default 34, for 16 users: nvidia-smi showed 8.2-9.3 GiB for
#                llama.cpp against 8.5-8.6 GiB for ferryman at 32; VRAM logged per run) and
#                `ferryman serve FILE --gpu-memory 8GiB`; ~4 min
#   link         link-read decode (decode_misses="link", experts/link_table.py): its GPU tests, the decode kernel
#                reading misses over the link against copying them first (bench_host_reads.py, gpt-oss-20b and
#                qwen3-30b-a3b Q4_K_M layers), then gpt-oss-20b at 8 GiB decoding with copy and link, alternated
#                twice (bench_offload --decode-misses); ~7 min
#   linkqwen     the same A/B on ggufqwen's file at 8 GiB (a 48-layer model whose copy-path decode is bound by
#                the host: docs/benchmarks.md), copy and link alternated twice; ~6 min with the file written
#   linkquant    qwen3-30b-a3b at 8 GiB with bf16, fp8 and int4 dummy experts (QUANTS), copy and link each: the
#                formats' decode ratios of issue 21 in each mode (its int4 decode was bound by the host); ~7 min
#   linkoss      gpt-oss-20b at 8 GiB decoding with copy and link once each (--moe-strategy offload: LINKARGS)
#   linkmx       which fp4 layouts the decode kernel reads well over the link (the planner reads links for a
#                format only where it does, ExpertFormat.link_reads): bench_host_reads at gpt-oss-20b's layer
#                shape for MXFP4 (scales apart), GGUF MXFP4 (scales inside 17-byte blocks) and NVFP4, then the
#                ggufoss stage's GGUF at 8 GiB decoding with copy and link; ~7 min with the GGUF written
#   compare      the stages in COMPARE (default "offload20 serve16") for this tree, then for the tree at
#                $OLD (its own benchmarks and package; one bench client, this tree's), and a table of
#                both; with both stages it takes about 9 minutes: COMPARE=offload20, then
#                COMPARE=serve16 in a second call, if the budget runs out. COMPARE=longprompt20: TTFT at
#                4,170 / 16k / 32k through default servers of both trees, alternated twice (~3-9 min);
#                COMPARE=prefill20: the same lengths in process (profile_prefill.py), alternated twice (~2 min);
#                COMPARE=int4qwen: qwen3-30b-a3b int4 at 8 GiB, one sequence's decode (link steps), alternated
#                twice (~4 min); COMPARE=decode20: gpt-oss-20b at 8 GiB, one sequence's decode only (the copy
#                path), alternated three times (~5 min)
set -uo pipefail
cd "$(dirname "$0")/.."
LINKARGS=${LINKARGS---moe-strategy offload}  # link steps need every MoE layer on the GPU path
ROOT=$PWD
OUT=$(mkdir -p "${OUT:-$ROOT/gpu-out}" && cd "${OUT:-$ROOT/gpu-out}" && pwd)
export PYTHONUNBUFFERED=1
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi
pypath() { echo "$1${SITE:+:$SITE}"; }  # pypath TREE: the PYTHONPATH that imports ferryman from TREE
export PYTHONPATH="$(pypath "$ROOT")"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
echo "tree: $(git log -1 --format='%h %cs %s' 2>/dev/null || echo "$ROOT") (the device's copy of .git may lag the files)"
# the files themselves: the same command in a checkout of the commit run gives the same hash
echo "code: $(find ferryman benchmarks tools -name '*.py' -o -name '*.sh' -o -name '*.c' -o -name '*.h' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"

BIG_GROUPED="tests/test_grouped_moe.py::test_grouped_moe_on_cuda_gpt_oss_20b_layer[300]"
PYTEST=(python3 -m pytest -v -m gpu -p no:cacheprovider -o faulthandler_timeout=90)

SUITE_END=$(( $(date +%s) + ${SUITE_BUDGET:-560} - 20 ))
have() { [ $(( SUITE_END - $(date +%s) )) -ge "$1" ]; }  # have SECONDS: that much budget is left
stage() {  # stage NAME SECONDS COMMAND...: log in $OUT/NAME.log, its tail and exit status here
  local name=$1 secs=$2; shift 2
  local left=$(( SUITE_END - $(date +%s) ))
  if [ "$left" -lt 30 ]; then echo "=== $name skipped: the suite budget is spent"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  echo "=== $name (limit ${secs}s): $*"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log"; echo "=== $name rc=$rc"
}
in_tree() {  # in_tree TREE: IN_TREE=(the prefix that runs a command in TREE, importing TREE's ferryman)
  IN_TREE=(env -C "$1" PYTHONPATH="$(pypath "$1")")
}

server_up() {  # server_up NAME PORT WAIT COMMAND...: COMMAND in the background (log $OUT/NAME_server.log),
  # SRV its pid; waits up to WAIT seconds for its /health; 1 (and the log's tail) when it exited
  local name=$1 port=$2 wait=$3; shift 3
  "$@" > "$OUT/${name}_server.log" 2>&1 &
  SRV=$!
  for _ in $(seq 1 "$wait"); do
    curl -sf "127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$SRV" 2>/dev/null || { echo "=== $name: the server exited"; tail -n 25 "$OUT/${name}_server.log"; return 1; }
    sleep 1
  done
}
server_down() { kill "$SRV" 2>/dev/null; wait "$SRV" 2>/dev/null; }  # the server server_up started

offload() {  # offload NAME TARGET SECONDS [TREE [ARGS...]]: bench_offload on one target
  local name=$1 target=$2 secs=$3
  in_tree "${4:-$ROOT}"
  stage "$name" "$secs" "${IN_TREE[@]}" python3 benchmarks/bench_offload.py --target "$target" --json "$OUT/$name.json" \
    "${@:5}"
}

serve16() {  # serve16 NAME PORT [TREE]: gpt-oss-20b at 8 GiB, 16 users
  local name=$1 port=$2
  have 100 || { echo "=== $name skipped: the suite budget is spent"; return; }
  in_tree "${3:-$ROOT}"
  server_up "$name" "$port" 120 "${IN_TREE[@]}" python3 -m ferryman serve gpt-oss-20b --load-format dummy \
    --gpu-memory 8GiB --max-model-len 1536 --max-num-seqs 16 --port "$port" --log-level warning || return
  stage "$name" 120 python3 -m ferryman bench serve "http://127.0.0.1:$port" --concurrency 16 \
    --prompt-tokens 1024 --output-tokens 128 --json "$OUT/$name.json"
  curl -s "127.0.0.1:$port/v1/stats" > "$OUT/${name}_stats.json"
  server_down
}

split() {  # split NAME PORT MODEL BUDGET LEVELS REQUESTS [8K]: one server for 32 sequences of 8192 tokens
  local name=$1 port=$2 model=$3 budget=$4 levels=$5 reqs=$6 long=${7:-} url="http://127.0.0.1:$2"
  local model_args=("$model" --gpu-memory "$budget" --max-num-seqs 32 --max-model-len 8192)
  have 150 || { echo "=== $name skipped: the suite budget is spent"; return; }
  stage "${name}_plan" 60 python3 -m ferryman plan "${model_args[@]}"
  server_up "$name" "$port" 240 python3 -m ferryman serve "${model_args[@]}" --load-format dummy --port "$port" \
    --log-level warning || return
  stage "$name" "${SPLIT_LIMIT:-200}" python3 -m ferryman bench serve "$url" --concurrency "$levels" \
    ${reqs:+--requests-per-level "$reqs"} \
    --prompt-tokens 1024 --output-tokens 128 --json "$OUT/$name.json"
  python3 -m ferryman ctl --url "$url" | tee "$OUT/${name}_ctl.txt"
  if [ -n "$long" ]; then
    stage "${name}_8k" 90 python3 -m ferryman bench serve "$url" --concurrency 1 --requests-per-level 0 \
      --prompt-tokens "$long" --output-tokens 128 --json "$OUT/${name}_8k.json"
  fi
  python3 -m ferryman ctl --url "$url" --json > "$OUT/${name}_ctl.json"
  curl -s "$url/v1/stats" > "$OUT/${name}_stats.json"
  curl -s "$url/metrics" | grep -E "^ferryman_(memory_split|memory_moves|kv_blocks|preemptions)" \
    | tee "$OUT/${name}_metrics.txt"
  grep -ci "out of memory" "$OUT/${name}_server.log" | sed 's/^/CUDA OOM lines in the server log: /'
  server_down
  # the link rate from the server's stats; the device's compute from the calibration, else measured now
  stage "${name}_vs_plan" 60 python3 benchmarks/bench_split.py "$OUT/$name.json" ${long:+"$OUT/${name}_8k.json"} \
    --model "$model" --gpu-memory "$budget" --stats "$OUT/${name}_stats.json" --json "$OUT/${name}_vs_plan.json"
}

strategy() {  # strategy NAME [LIMIT]: bench_offload of gpt-oss-20b at 8 GiB with --moe-strategy NAME
  stage "strategy_$1" "${2:-120}" python3 benchmarks/bench_offload.py --target gpt-oss-20b:8GiB --moe-strategy "$1" \
    --decode-tokens 128 --prefill-prompt 0 --json "$OUT/strategy_$1.json"
}

table() {  # table NEW.json OLD.json: the headline figures of both runs side by side
  python3 - "$1" "$2" <<'EOF'
import json, sys
KEYS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "decode_hit_rate", "h2d_mib_per_token",  # bench_offload
        "output_tokens_per_s", "ttft_s_p50", "ttft_s_p99", "itl_s_p50", "itl_s_p99", "tpot_s_p50", "errors")  # bench serve
def row(path):
    try:
        data = json.load(open(path))
    except (OSError, ValueError):
        return {}
    data = data[0] if isinstance(data, list) else data["levels"][-1]
    return {k: data[k] for k in KEYS if k in data}
new, old = row(sys.argv[1]), row(sys.argv[2])
print(f"{'':22s} {'this tree':>12s} {'old tree':>12s}  {sys.argv[1].rsplit('/', 1)[-1]}")
for k in KEYS:
    if k in new or k in old:
        f = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"{k:22s} {f(new.get(k)):>12s} {f(old.get(k)):>12s}")
EOF
}

ttft_table() {  # ttft_table JSON...: bench_long_prompt's TTFT per prompt length, a column per run
  python3 - "$@" <<'EOF'
import json, sys
runs = {}
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1][:-5]
    try:
        runs[name] = {lv["prompt_tokens"]: (lv.get("ttft_s"), lv.get("probe_us"))
                      for lv in json.load(open(path))["levels"]}
    except (OSError, ValueError, KeyError):
        runs[name] = {}
lengths = sorted({n for r in runs.values() for n in r})
cell = lambda t, p: "-" if t is None else f"{t:.3f}" + ("" if p is None else f" ({p:.0f} us)")  # probe_us
print("prompt  " + " ".join(f"{k:>20s}" for k in runs) + "   (host probe_us: lower is faster)")
for n in lengths:
    print(f"{n:6d}  " + " ".join(f"{cell(*r.get(n, (None, None))):>20s}" for r in runs.values()))
EOF
}

longprompt() {  # longprompt NAME PORT MODEL BUDGET LENGTHS STALL [TREE]: bench_long_prompt through a default
  # server (TREE's ferryman; the client is this tree's)
  local name=$1 port=$2
  have 120 || { echo "=== $name skipped: the suite budget is spent"; return; }
  in_tree "${7:-$ROOT}"
  server_up "$name" "$port" 240 "${IN_TREE[@]}" python3 -m ferryman serve "$3" --load-format dummy --gpu-memory "$4" \
    --port "$port" --log-level warning || return
  stage "$name" 180 python3 benchmarks/bench_long_prompt.py "http://127.0.0.1:$port" --lengths "$5" \
    --stall-prompt "$6" --json "$OUT/$name.json"
  server_down
}

GGUF=${GGUF_DIR:-/tmp}/qwen3-30b-a3b-q4_k_m.gguf
PEER=${PEER_KIT:-$ROOT/.peer-kit}
CLIENTS=/tmp/peer-clients  # the peer kit's load clients with tools/peer_client.py's fixes

OSS=${GGUF_DIR:-/tmp}/gptoss20b
OSS_GGUF=$OSS-mxfp4.gguf

oss_write() {  # gpt-oss-20b's random folder and llama.cpp's conversion of it, once per machine
  [ -f "$OSS/model.safetensors.index.json" ] || stage ggufoss_gen 120 python3 "$PEER/gen_gptoss.py" --out "$OSS" \
    --workers 8  # its index is written last
  [ -f /tmp/llama.cpp/convert_hf_to_gguf.py ] || tar xJf "$PEER/llama_src.tar.xz" -C /tmp
  [ -f "$OSS_GGUF" ] || stage ggufoss_convert 240 bash -c "python3 '$PEER/gen_gguf.py' --llama-dir /tmp/llama.cpp \
    --model '$OSS' --outfile '$OSS-part.gguf' && mv '$OSS-part.gguf' '$OSS_GGUF'"
}

gguf_write() {  # the benchmark GGUF, once per machine
  [ -f "$GGUF" ] || stage gguf_write 300 python3 -m tools.gguf_random --preset qwen3-30b-a3b --mix q4_k_m --out "$GGUF"
}

peer_serve() {  # peer_serve NAME PORT USERS COMMAND...: a server, then the peer kit's client at 1 or 16 users
  local name=$1 port=$2 users=$3; shift 3
  "$@" > "$OUT/${name}_server.log" 2>&1 &
  SRV=$!
  python3 "$CLIENTS/bench_client.py" --url "http://127.0.0.1:$port" --wait 240 --wait-only >/dev/null 2>&1
  if [ "$users" = 1 ]; then
    stage "$name" 200 python3 "$CLIENTS/bench_client.py" --url "http://127.0.0.1:$port" --prompt-tokens 512,4096 \
      --max-tokens 128 --runs 2 --label "$name"
  else
    stage "$name" 150 python3 "$CLIENTS/load_client.py" --url "http://127.0.0.1:$port" --concurrency "$users" \
      --prompt-tokens 1024 --max-tokens 128 --per-user 1 --label "$name"
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee "$OUT/${name}_vram.txt"
  server_down
}

compare() {  # each stage of $COMPARE on this tree, then on $OLD
  local old=${OLD:?compare needs OLD=path of the older tree}
  old=$(cd "$old" && pwd) || exit 2
  echo "old tree: $old"
  local port=8140 s
  for s in ${COMPARE:-offload20 serve16}; do
    case "$s" in
      offload20) offload offload20_new gpt-oss-20b:8GiB 150
                 offload offload20_old gpt-oss-20b:8GiB 150 "$old" ;;
      serve16)   serve16 serve16_new $((port++))
                 serve16 serve16_old $((port++)) "$old" ;;
      longprompt20)  # TTFT at 4,170 / 16k / 32k, no stall run, the trees alternated twice
                 for r in 1 2; do
                   longprompt "longprompt20_new$r" $((port++)) gpt-oss-20b 8GiB 4170,16384,32000 0
                   longprompt "longprompt20_old$r" $((port++)) gpt-oss-20b 8GiB 4170,16384,32000 0 "$old"
                 done
                 ttft_table "$OUT"/longprompt20_{new,old}{1,2}.json | tee "$OUT/${s}_compare.txt"
                 continue ;;
      prefill20) # in process (profile_prefill.py): TTFT at 4,170 / 16k / 32k, each twice, the trees alternated twice
                 for r in 1 2; do for t in new old; do
                   in_tree "$([ "$t" = new ] && echo "$ROOT" || echo "$old")"
                   stage "prefill20_${t}$r" 150 "${IN_TREE[@]}" python3 benchmarks/profile_prefill.py --model gpt-oss-20b \
                     --load-format dummy --gpu-memory 8GiB --lengths 4170,16384,32000
                 done; done
                 grep -h "TTFT" "$OUT"/prefill20_*.log | tee "$OUT/${s}_compare.txt"
                 continue ;;
      decode20)  # gpt-oss-20b at 8 GiB, one sequence's decode only (the copy path), the trees alternated three
                 # times: the host's speed moves these runs by up to 1.3x (each JSON's decode_host.probe_us)
                 for r in 1 2 3; do
                   offload "decode20_new$r" gpt-oss-20b:8GiB 100 "$ROOT" --decode-tokens 128 --ttft-prompt 0 \
                     --prefill-prompt 0
                   offload "decode20_old$r" gpt-oss-20b:8GiB 100 "$old" --decode-tokens 128 --ttft-prompt 0 \
                     --prefill-prompt 0
                   table "$OUT/decode20_new$r.json" "$OUT/decode20_old$r.json" | tee -a "$OUT/${s}_compare.txt"
                 done
                 continue ;;
      int4qwen)  # qwen3-30b-a3b int4 at 8 GiB, one sequence's decode (link steps under auto), alternated twice
                 for r in 1 2; do
                   offload "int4qwen_new$r" qwen3-30b-a3b:8GiB:int4 100 "$ROOT" --decode-tokens 128 --ttft-prompt 0 \
                     --prefill-prompt 0
                   offload "int4qwen_old$r" qwen3-30b-a3b:8GiB:int4 100 "$old" --decode-tokens 128 --ttft-prompt 0 \
                     --prefill-prompt 0
                   table "$OUT/int4qwen_new$r.json" "$OUT/int4qwen_old$r.json" | tee -a "$OUT/${s}_compare.txt"
                 done
                 continue ;;
      *) echo "compare: no stage $s (offload20, decode20, serve16, longprompt20, prefill20, int4qwen)"; exit 2 ;;
    esac
    table "$OUT/${s}_new.json" "$OUT/${s}_old.json" | tee "$OUT/${s}_compare.txt"
  done
}

for s in ${@:-tests}; do
  case "$s" in
    tests)       stage gpu_tests "${TESTS_LIMIT:-240}" "${PYTEST[@]}" --durations=15 --deselect "$BIG_GROUPED" tests/ ;;
    grouped)     stage gpu_grouped 120 "${PYTEST[@]}" "$BIG_GROUPED" ;;
    resident)    stage resident_decode 150 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy \
                   --tokens 256
                 stage resident_offload 150 python3 benchmarks/bench_offload.py --target gpt-oss-20b:40GiB \
                   --decode-tokens 256 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/resident_offload.json" ;;
    offload20)   offload offload20 gpt-oss-20b:8GiB 150 ;;
    split)       split split 8150 gpt-oss-20b 8GiB 1,4,32 "" 7900
                 SPLIT_LIMIT=400 split split120 8151 gpt-oss-120b 16GiB 1,2,4,8,16,32 0 ;;
    split20)     split split 8150 gpt-oss-20b 8GiB 1,4,32 "" 7900 ;;
    split120)    SPLIT_LIMIT=400 split split120 8151 gpt-oss-120b 16GiB 1,2,4,8,16,32 0 ;;
    offload120)  offload offload120 gpt-oss-120b:16GiB 200 ;;
    spread20)    for r in 1 2 3; do for pin in "" "${MAIN_CPU:-3}"; do  # one-sequence decode, main thread free / pinned
                   offload "spread20_${r}_${pin:-free}" gpt-oss-20b:8GiB 100 "$ROOT" --moe-strategy offload \
                     --decode-tokens 128 --ttft-prompt 0 --prefill-prompt 0 ${pin:+--main-cpu "$pin"}
                 done; done ;;
    prof16k)     stage prof16k 200 python3 benchmarks/profile_prefill.py --model gpt-oss-20b --load-format dummy \
                   --gpu-memory 8GiB --max-model-len 32832 --lengths 16384 --gaps --python ;;
    profdecode)  stage profdecode_qwen 120 python3 benchmarks/profile_decode.py --model qwen3-30b-a3b --load-format dummy \
                   --gpu-memory 8GiB --quantization int4 --gaps
                 stage profdecode_oss 120 python3 benchmarks/profile_decode.py --model gpt-oss-20b --load-format dummy \
                   --gpu-memory 8GiB --gaps ;;
    decodehost)  stage decodehost_oss 60 python3 benchmarks/bench_decode_host.py --model gpt-oss-20b --quantization none \
                   --device cuda --calls 2000
                 stage decodehost_qwen 60 python3 benchmarks/bench_decode_host.py --device cuda --calls 2000
                 stage decodehost_probe 20 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); \
from host_usage import probe_us; print('probe_us', [probe_us() for _ in range(5)])" ;;
    threadteams) stage threadteams_oss 120 python3 benchmarks/bench_thread_teams.py --model gpt-oss-20b --load-format dummy \
                   --layers 2 --calls 200
                 stage threadteams_demo 60 python3 benchmarks/bench_thread_teams.py ;;
    tail20)      stage tail20 100 python3 benchmarks/profile_prefill.py --model gpt-oss-20b --load-format dummy \
                   --gpu-memory 8GiB --lengths 4096,4170,4096,4170 --gaps
                 stage tail20_one 100 python3 benchmarks/profile_prefill.py --model gpt-oss-20b --load-format dummy \
                   --gpu-memory 8GiB --lengths 4170,4096,4170 --max-num-batched-tokens 4352 ;;
    offloadqwen) offload offloadqwen qwen3-30b-a3b:8GiB 170 ;;
    quant)       stage quant_tests 90 "${PYTEST[@]}" tests/test_fp8_nvfp4.py tests/test_quant_checkpoints.py
                 for q in ${QUANTS:-none fp8 nvfp4}; do
                   offload "quant_$q" "qwen3-30b-a3b:8GiB:$q" 100 "$ROOT" --decode-tokens 128 --prefill-prompt 0
                 done ;;
    int4)        stage int4_tests 100 "${PYTEST[@]}" tests/test_intq.py tests/test_intq_models.py
                 offload int4_qwen qwen3-30b-a3b:8GiB:int4 100 "$ROOT" --decode-tokens 128 --prefill-prompt 0 ;;
    int4oss)     offload int4_oss120 gpt-oss-120b:16GiB:int4-g32 180 "$ROOT" --decode-tokens 128 --ttft-prompt 0 \
                   --prefill-prompt 0 ;;
    linktrial)   for t in gpt-oss-120b:16GiB:int4-g32 qwen3-30b-a3b:8GiB:int4; do
                   offload "linktrial_${t%%:*}" "$t" 240 "$ROOT" --decode-tokens 128 --settle-tokens 160 \
                     --ttft-prompt 0 --prefill-prompt 0
                 done ;;
    serve16)     serve16 serve16 8130 ;;
    longprompt)  longprompt longprompt20 8150 gpt-oss-20b 8GiB 4170,16384,32000 32000
                 longprompt longprompt120 8151 gpt-oss-120b 16GiB 32000 0 ;;
    longprompt20)  longprompt longprompt20 8150 gpt-oss-20b 8GiB 4170,16384,32000 32000 ;;
    longprompt120) longprompt longprompt120 8151 gpt-oss-120b 16GiB 32000 0 ;;
    prefix)      stage prefix 150 python3 benchmarks/bench_prefix_cache.py --model gpt-oss-20b --load-format dummy \
                   --prefix-tokens 4096 --tail-tokens 128 ;;
    families)    for t in ${FAMILIES:-glm-4.5-air:12:0 qwen3-next-80b-a3b:12:0 deepseek-v3:5:4096}; do
                   IFS=: read -r fam layers prefill <<<"$t"
                   offload "family_$fam" "$fam:16GiB" 240 "$ROOT" --layers "$layers" --decode-tokens 128 \
                     --prefill-prompt "$prefill"
                 done ;;
    hybridprefix) stage hybrid_prefix 240 python3 benchmarks/bench_prefix_cache.py --model qwen3-next-80b-a3b \
                   --load-format dummy --layers 12 --gpu-memory 16GiB --prefix-tokens 8192 --tail-tokens 200 \
                   --quantization "${HYBRID_QUANT:-none}" ;;
    hybridsteps) stage hybrid_ckpt_tests 90 "${PYTEST[@]}" tests/test_state_saves_in_chunk.py tests/test_delta_rule.py
                 stage hybrid_steps 150 python3 benchmarks/profile_prefill.py --model qwen3-next-80b-a3b \
                   --load-format dummy --layers 12 --gpu-memory 16GiB --quantization int4 --max-num-seqs 1 \
                   --lengths 8192 --turn 200 ;;
    prefillattn) stage prefill_attention 120 python3 benchmarks/bench_prefill_attention.py ;;
    kernels)     stage moe_kernel 90 python3 benchmarks/bench_fused_moe.py
                 stage attention 60 python3 benchmarks/bench_attention.py ;;
    strategies)  stage cpu_kernel_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_kernel.py \
                   -k "avx512bf16 or layer_job or decoded_tiles"
                 stage cpu_matrix 60 python3 benchmarks/bench_cpu_mxfp4.py --matrix --tokens 1,2,4,8,16,32
                 stage bench_bw 100 python3 -m ferryman bench bw gpt-oss-20b --reps 3 \
                   --output "$OUT/calibration.json" --json "$OUT/bench_bw.json"
                 strategy offload; strategy hybrid ;;
    bf16isa)     for isa in avx512bf16 avx512; do  # bf16 at 1-8 tokens: vdpbf16ps against the shift-and-FMA path
                   stage "cpu_matrix_$isa" 60 python3 benchmarks/bench_cpu_mxfp4.py --matrix --tokens 1,2,3,4,8 --isa "$isa"
                 done ;;
    strategies2) strategy layers 240; strategy auto; strategy cpu 240 ;;  # layers, cpu: >120 s on 2026-12-01
    cpupacked)   stage cpu_packed_tests 90 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_kernel_packed.py \
                   tests/test_cpu_kernel.py
                 for m in qwen3-30b-a3b gpt-oss-20b; do
                   stage "bench_bw_$m" 120 python3 -m ferryman bench bw "$m" --reps 10 \
                     --output "$OUT/calibration_$m.json" --json "$OUT/bench_bw_$m.json"
                 done ;;
    strategies8) for m in offload hybrid layers auto; do
                   stage "strategy8_$m" 60 python3 benchmarks/bench_batch_decode.py --target gpt-oss-20b:8GiB \
                     --seqs 8 --strategy "$m" --modes early --reps 1 --tokens 48 --json "$OUT/strategy8_$m.json"
                 done ;;
    groupedq)    stage groupedq_tests 120 "${PYTEST[@]}" tests/test_grouped_moe_quant.py
                 shapes=qwen3-30b-a3b,qwen3-30b-a3b-int4,qwen3-30b-a3b-fp8,qwen3-30b-a3b-nvfp4,qwen3-30b-a3b-q4_k_m
                 shapes=$shapes,qwen3-next-int4,qwen3-next-fp8,qwen3-next-nvfp4,qwen3-next-q4_k_m
                 stage prefill_moe_packed 240 python3 benchmarks/bench_prefill_moe.py --iters 10 \
                   --tokens "${PREFILL_TOKENS:-16,64,216,512,1024,2048,4096}" --shapes "${PREFILL_SHAPES:-$shapes}" ;;
    gguf)        stage gguf_tests 120 "${PYTEST[@]}" tests/test_gguf_triton.py
                 for f in gguf:q4_k:q4_k gguf:q4_k:q6_k mxfp4; do
                   stage "gguf_bench_${f//:/_}" 45 python3 benchmarks/bench_fused_moe.py --format "$f" --hidden 2048 \
                     --inter 768 --experts 128 --topk 8 --act silu
                 done ;;
    ggufqwen)    gguf_write
                 offload gguf_offload "$GGUF:8GiB" 240 "$ROOT" --decode-tokens 128 --prefill-prompt 0 ;;
    ggufoss)     oss_write
                 stage ggufoss 560 python3 benchmarks/bench_gguf_vs_folder.py --folder "$OSS" --gguf "$OSS_GGUF" \
                   --budget 8GiB --runs 2 --json "$OUT/ggufoss.json" -- --moe-strategy offload --decode-tokens 128 \
                   --prefill-prompt 0 ;;
    llamacpp_build) stage llamacpp_build 560 bash -c "tar xJf '$PEER/llama_src.tar.xz' -C /tmp \
                   && bash '$PEER/build_llama.sh' /tmp/llama.cpp 14" ;;
    llamacpp_prep) ( tar xJf "$PEER/llama_src.tar.xz" -C /tmp && bash "$PEER/build_llama.sh" /tmp/llama.cpp 14 \
                     > "$OUT/llamacpp_build.log" 2>&1; echo "build rc=$?" >> "$OUT/llamacpp_build.log" ) &
                   gguf_write
                   wait; tail -2 "$OUT/llamacpp_build.log"
                   offload gguf_offload "$GGUF:8GiB" 240 "$ROOT" --decode-tokens 128 --prefill-prompt 0 ;;
    llamacpp)    gguf_write
                 python3 tools/peer_client.py "$PEER" "$CLIENTS" || exit 1
                 LLAMA=(/tmp/llama.cpp/build/bin/llama-server -m "$GGUF" -ngl 99 --host 127.0.0.1)
                 # FERRY_ARGS: more server flags, e.g. --decode-misses link
                 FERRY=(python3 -m ferryman serve "$GGUF" --gpu-memory 8GiB --log-level warning ${FERRY_ARGS:-})
                 peer_serve llamacpp_1user 8150 1 "${LLAMA[@]}" --n-cpu-moe "${NCPUMOE1:-31}" -c 8192 -np 1 --port 8150
                 peer_serve ferryman_1user 8151 1 "${FERRY[@]}" --max-model-len 8192 --max-num-seqs 1 --port 8151
                 peer_serve llamacpp_16users 8152 16 "${LLAMA[@]}" --n-cpu-moe "${NCPUMOE16:-34}" -c 20480 -np 16 \
                   --port 8152
                 peer_serve ferryman_16users 8153 16 "${FERRY[@]}" --max-model-len 1280 --max-num-seqs 16 --port 8153 ;;
    linkmx)      for f in mxfp4 gguf:mxfp4:mxfp4 nvfp4; do
                   stage "host_reads_${f//:/_}" 60 python3 benchmarks/bench_host_reads.py --format "$f"
                 done
                 oss_write
                 for m in copy link; do
                   offload "linkmx_gguf_$m" "$OSS_GGUF:8GiB" 150 "$ROOT" --decode-misses "$m" --decode-tokens 128 \
                     $LINKARGS --prefill-prompt 0 --ttft-prompt 0
                 done ;;
    linkoss)     for m in copy link; do
                   offload "linkoss_$m" gpt-oss-20b:8GiB 150 "$ROOT" --decode-misses "$m" --decode-tokens 128 $LINKARGS \
                     --prefill-prompt 0 --ttft-prompt 0
                 done ;;
    link)        stage link_tests 150 "${PYTEST[@]}" tests/test_fused_moe_host.py tests/test_link_reads.py
                 stage host_reads_oss 60 python3 benchmarks/bench_host_reads.py
                 stage host_reads_qwen 60 python3 benchmarks/bench_host_reads.py --format gguf:q4_k:q6_k --hidden 2048 \
                   --inter 768 --experts 128 --topk 8 --act silu
                 for r in 1 2; do for m in copy link; do  # alternated: single runs spread (docs/benchmarks.md)
                   offload "link_oss_${m}_$r" gpt-oss-20b:8GiB 150 "$ROOT" --decode-misses "$m" --decode-tokens 128 $LINKARGS \
                     --prefill-prompt 0 --ttft-prompt 0
                 done; done ;;
    linkquant)   for q in ${QUANTS:-none fp8 int4}; do for m in copy link; do
                   offload "linkquant_${q}_$m" "qwen3-30b-a3b:8GiB:$q" 120 "$ROOT" --decode-misses "$m" \
                     --decode-tokens 128 --prefill-prompt 0 --ttft-prompt 0
                 done; done ;;
    linkqwen)    gguf_write
                 for r in 1 2; do for m in copy link; do
                   offload "linkqwen_${m}_$r" "$GGUF:8GiB" 200 "$ROOT" --decode-misses "$m" --decode-tokens 128 $LINKARGS \
                     --prefill-prompt 0 --ttft-prompt 0
                 done; done ;;
    compare)     compare ;;
    *) echo "unknown stage $s: the stages are listed at the top of $0"; exit 2 ;;
  esac
done
# The device tool returns few files from $OUT: pack everything into one archive.
( cd "$OUT" && files=$(ls -A | grep -v '^suite.tgz$') && [ -n "$files" ] && tar czf suite.tgz $files && rm -rf $files )
echo "=== logs and JSON: $OUT/suite.tgz"
