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
#   git archive --prefix=.old/ <rev> ferryman benchmarks ':(exclude)ferryman/assets' | tar -x
#   device run --carry .whl --carry .old: OLD=.old tools/gpu_suite.sh compare
#
# Stages (default: tests):
#   tests        the GPU tests (pytest -m gpu), but the 300-token grouped-kernel test
#   grouped      that test alone
#   resident     gpt-oss-20b resident decode (bench_decode), then bench_offload at 40 GiB, which plans
#                every expert on the GPU
#   offload20    gpt-oss-20b at 8 GiB (bench_offload): link, decode tok/s, TTFT of a 4k prompt, 8k prefill
#   offload120   gpt-oss-120b at 16 GiB, the same figures
#   offloadqwen  qwen3-30b-a3b at 8 GiB, the same figures
#   serve16      `ferryman serve gpt-oss-20b` at 8 GiB (16 sequences, 1536 tokens), then `ferryman bench
#                serve` with 16 users, 1024 prompt / 128 output tokens
#   prefix       TTFT with and without a cached 4k prefix (bench_prefix_cache, gpt-oss-20b)
#   kernels      the MoE and attention kernel benchmarks
#   families     bench_offload at 16 GiB on the first layers of glm-4.5-air (12), qwen3-next-80b-a3b (12)
#                and deepseek-v3 (5: 3 dense, 2 MoE): bf16 experts of 45-68 GiB do not fit the host
#                RAM whole; decode time per layer compares with offload120's; deepseek-v3 also prefills a
#                4096-token prompt (MLA's expanded prefill: its prefill tok/s and peak_gib)
#   hybridprefix an agent's second turn on qwen3-next-80b-a3b (12 layers, 16 GiB): 8k context, then a
#                200-token turn, restored from a state checkpoint, against the same prompt cold
#   compare      the stages in COMPARE (default "offload20 serve16") for this tree, then for the tree at
#                $OLD (its own benchmarks and package; one bench client, this tree's), and a table of
#                both; with both stages it takes about 9 minutes: COMPARE=offload20, then
#                COMPARE=serve16 in a second call, if the budget runs out
set -uo pipefail
cd "$(dirname "$0")/.."
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
echo "tree: $(git log -1 --format='%h %cs %s' 2>/dev/null || echo "$ROOT")"

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
  "${IN_TREE[@]}" python3 -m ferryman serve gpt-oss-20b --load-format dummy --gpu-memory 8GiB --max-model-len 1536 \
    --max-num-seqs 16 --port "$port" --log-level warning > "$OUT/${name}_server.log" 2>&1 &
  local srv=$!
  for _ in $(seq 1 120); do
    curl -sf "127.0.0.1:$port/health" >/dev/null && break
    kill -0 "$srv" 2>/dev/null || { echo "=== $name: the server exited"; tail -n 25 "$OUT/${name}_server.log"; return; }
    sleep 1
  done
  stage "$name" 120 python3 -m ferryman bench serve "http://127.0.0.1:$port" --concurrency 16 \
    --prompt-tokens 1024 --output-tokens 128 --json "$OUT/$name.json"
  curl -s "127.0.0.1:$port/v1/stats" > "$OUT/${name}_stats.json"
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
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
      *) echo "compare: no stage $s (offload20, serve16)"; exit 2 ;;
    esac
    table "$OUT/${s}_new.json" "$OUT/${s}_old.json" | tee "$OUT/${s}_compare.txt"
  done
}

for s in ${@:-tests}; do
  case "$s" in
    tests)       stage gpu_tests 240 "${PYTEST[@]}" --durations=15 --deselect "$BIG_GROUPED" tests/ ;;
    grouped)     stage gpu_grouped 120 "${PYTEST[@]}" "$BIG_GROUPED" ;;
    resident)    stage resident_decode 150 python3 benchmarks/bench_decode.py --model gpt-oss-20b --load-format dummy \
                   --tokens 256
                 stage resident_offload 150 python3 benchmarks/bench_offload.py --target gpt-oss-20b:40GiB \
                   --decode-tokens 256 --ttft-prompt 0 --prefill-prompt 0 --json "$OUT/resident_offload.json" ;;
    offload20)   offload offload20 gpt-oss-20b:8GiB 150 ;;
    offload120)  offload offload120 gpt-oss-120b:16GiB 200 ;;
    offloadqwen) offload offloadqwen qwen3-30b-a3b:8GiB 170 ;;
    serve16)     serve16 serve16 8130 ;;
    prefix)      stage prefix 150 python3 benchmarks/bench_prefix_cache.py --model gpt-oss-20b --load-format dummy \
                   --prefix-tokens 4096 --tail-tokens 128 ;;
    families)    for t in glm-4.5-air:12:0 qwen3-next-80b-a3b:12:0 deepseek-v3:5:4096; do
                   IFS=: read -r fam layers prefill <<<"$t"
                   offload "family_$fam" "$fam:16GiB" 240 "$ROOT" --layers "$layers" --decode-tokens 128 \
                     --prefill-prompt "$prefill"
                 done ;;
    hybridprefix) stage hybrid_prefix 240 python3 benchmarks/bench_prefix_cache.py --model qwen3-next-80b-a3b \
                   --load-format dummy --layers 12 --gpu-memory 16GiB --prefix-tokens 8192 --tail-tokens 200 ;;
    kernels)     stage moe_kernel 90 python3 benchmarks/bench_fused_moe.py
                 stage attention 60 python3 benchmarks/bench_attention.py ;;
    compare)     compare ;;
    *) echo "unknown stage $s: the stages are listed at the top of $0"; exit 2 ;;
  esac
done
# The device tool returns few files from $OUT: pack everything into one archive.
( cd "$OUT" && files=$(ls -A | grep -v '^suite.tgz$') && [ -n "$files" ] && tar czf suite.tgz $files && rm -rf $files )
echo "=== logs and JSON: $OUT/suite.tgz"
