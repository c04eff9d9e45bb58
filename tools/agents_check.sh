#!/usr/bin/env bash
# Run the four coding agents people point at local servers against `ferryman serve`, as a user
# would: each one non-interactively, with a tiny task and a time limit. Run by hand (not in CI):
# it installs the agents from npm and needs a few minutes of CPU per agent on the demo model.
#
#   tools/agents_check.sh [--prefix DIR] [--timeout S] [--task TEXT] [--max-output N] [--capture DIR]
#                         [--only AGENT] [-- SERVE ARGS...]
#
#   --prefix DIR   npm prefix the agents are installed into (default /tmp/ferryman-agents)
#   --timeout S    seconds each agent may run (default 1800)
#   --task TEXT    the prompt (default "Say hi.")
#   --max-output N output tokens per model call (default 256), set through each agent's own setting
#                  (CLAUDE_CODE_MAX_OUTPUT_TOKENS, opencode's limit.output, QWEN_CODE_MAX_OUTPUT_TOKENS):
#                  they ask for 8k-32k, and the demo model (a Python completer) rarely stops early.
#                  Codex has no such setting and sends no limit: it writes until the model stops or
#                  the context is full, and a server-side cap (--max-tokens-default) would end its
#                  response `incomplete`, which Codex reports as an error
#   --capture DIR  put tools/agents_proxy.py in front of the server: DIR/<agent>/NN.json hold each
#                  request (the raw material of tests/fixtures/agents, see tools/agents_fixtures.py)
#   --only AGENT   run one agent: claude-code, codex, opencode or qwen-code (repeatable)
#   SERVE ARGS     passed to `python -m ferryman serve` (default: the demo model on the CPU)
#
# Prints one line per agent (PASS = exit status 0) and the last line the agent wrote on failure.
# Each agent runs with a scratch HOME and working folder, so no user configuration takes part.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/tmp/ferryman-agents
TIMEOUT=1800
TASK="Say hi."
MAX_OUTPUT=256
CAPTURE=""
ONLY=()
SERVE_ARGS=(--device cpu)
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --task) TASK=$2; shift 2 ;;
    --max-output) MAX_OUTPUT=$2; shift 2 ;;
    --capture) CAPTURE=$2; shift 2 ;;
    --only) ONLY+=("$2"); shift 2 ;;
    --) shift; SERVE_ARGS=("$@"); break ;;
    *) echo "agents_check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
AGENTS=(claude-code codex opencode qwen-code)
[ ${#ONLY[@]} -gt 0 ] && AGENTS=("${ONLY[@]}")
MODEL=demo-moe
KEY=sk-ferryman-agents-check
SCRATCH=$(mktemp -d /tmp/ferryman-agents-run.XXXXXX)
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done; }
trap cleanup EXIT

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() {  # wait_http URL SECONDS
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    [ $SECONDS -ge $deadline ] && return 1
    sleep 1
  done
}

# ---- the agents -----------------------------------------------------------------------------
echo "installing the agents into $PREFIX ..."
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error \
  @anthropic-ai/claude-code @openai/codex opencode-ai @qwen-code/qwen-code >"$SCRATCH/npm.log" 2>&1 \
  || { echo "npm install failed:"; tail -5 "$SCRATCH/npm.log"; exit 1; }
BIN=$PREFIX/node_modules/.bin
NODE_DIR=$(dirname "$(command -v node)")

# ---- the server -----------------------------------------------------------------------------
PORT=$(free_port)
(cd "$ROOT" && exec python -m ferryman serve --port "$PORT" --served-model-name "$MODEL" --api-key "$KEY" \
  --log-level warning "${SERVE_ARGS[@]}") >"$SCRATCH/serve.log" 2>&1 &
PIDS+=($!)
if ! wait_http "http://127.0.0.1:$PORT/health" 300; then
  echo "ferryman serve did not start:"; tail -5 "$SCRATCH/serve.log"; exit 1
fi
CONTEXT=$(curl -s -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/v1/models" \
  | python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["max_model_len"])')
echo "ferryman serve on port $PORT, context $CONTEXT tokens (log: $SCRATCH/serve.log)"

# start_endpoint AGENT: URL = where the agent talks to (through a logging proxy under --capture)
start_endpoint() {
  URL=http://127.0.0.1:$PORT
  [ -z "$CAPTURE" ] && return
  local port; port=$(free_port)
  python "$ROOT/tools/agents_proxy.py" --upstream "$URL" --port "$port" --out "$CAPTURE/$1" \
    >"$SCRATCH/proxy-$1.log" 2>&1 &
  PIDS+=($!)
  URL=http://127.0.0.1:$port
  wait_http "$URL/health" 30
}

# configure AGENT HOME URL: write the agent's configuration for a custom endpoint
configure() {
  case "$1" in
    codex)
      mkdir -p "$2/.codex"
      cat >"$2/.codex/config.toml" <<EOF
model = "$MODEL"
model_provider = "ferryman"

[model_providers.ferryman]
name = "ferryman"
base_url = "$3/v1"
env_key = "FERRYMAN_AGENTS_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = $((TIMEOUT * 1000))
EOF
      ;;
    opencode)
      mkdir -p "$2/.config/opencode"
      cat >"$2/.config/opencode/opencode.json" <<EOF
{"\$schema": "https://opencode.ai/config.json", "autoupdate": false, "share": "disabled",
 "model": "ferryman/$MODEL",
 "provider": {"ferryman": {"npm": "@ai-sdk/openai-compatible", "name": "ferryman",
   "options": {"baseURL": "$3/v1", "apiKey": "$KEY"},
   "models": {"$MODEL": {"name": "$MODEL", "limit": {"context": $CONTEXT, "output": $MAX_OUTPUT}}}}}}
EOF
      ;;
  esac
}

# run AGENT URL HOME: the agent's command line, in a clean environment
run_agent() {
  local env=(env -i "PATH=$BIN:$NODE_DIR:/usr/bin:/bin" "HOME=$3" TERM=dumb)
  case "$1" in
    claude-code)
      "${env[@]}" ANTHROPIC_BASE_URL="$2" ANTHROPIC_API_KEY="$KEY" ANTHROPIC_MODEL="$MODEL" \
        ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="$MAX_OUTPUT" \
        timeout "$TIMEOUT" claude -p "$TASK" ;;
    codex)
      "${env[@]}" CODEX_HOME="$3/.codex" FERRYMAN_AGENTS_KEY="$KEY" \
        timeout "$TIMEOUT" codex exec --skip-git-repo-check "$TASK" ;;
    opencode)
      "${env[@]}" timeout "$TIMEOUT" opencode run -m "ferryman/$MODEL" "$TASK" ;;
    qwen-code)
      "${env[@]}" OPENAI_BASE_URL="$2/v1" OPENAI_API_KEY="$KEY" OPENAI_MODEL="$MODEL" \
        QWEN_CODE_MAX_OUTPUT_TOKENS="$MAX_OUTPUT" \
        timeout "$TIMEOUT" qwen --auth-type openai -m "$MODEL" "$TASK" ;;
    *) echo "unknown agent '$1' (claude-code, codex, opencode, qwen-code)"; return 2 ;;
  esac
}

version() {
  case "$1" in
    claude-code) "$BIN/claude" --version ;; codex) "$BIN/codex" --version ;;
    opencode) echo "opencode $("$BIN/opencode" --version)" ;; qwen-code) echo "qwen-code $("$BIN/qwen" --version)" ;;
  esac 2>/dev/null | head -1
}

FAILED=0
for agent in "${AGENTS[@]}"; do
  home=$SCRATCH/home-$agent work=$SCRATCH/work-$agent
  mkdir -p "$home" "$work"
  printf 'print("hello")\n' >"$work/hello.py"
  printf '# A small project\n' >"$work/README.md"
  start_endpoint "$agent"
  configure "$agent" "$home" "$URL"
  start=$SECONDS
  (cd "$work" && run_agent "$agent" "$URL" "$home" </dev/null >"$SCRATCH/$agent.out" 2>&1)
  rc=$?
  took=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    printf 'PASS %-12s %-28s %4ds  %s\n' "$agent" "$(version "$agent")" "$took" \
      "$(grep -v '^\s*$' "$SCRATCH/$agent.out" | tail -1 | cut -c1-100)"
  else
    FAILED=$((FAILED + 1))
    why=$([ $rc -eq 124 ] && echo "timed out after ${TIMEOUT}s" || echo "exit $rc")
    printf 'FAIL %-12s %-28s %4ds  %s: %s\n' "$agent" "$(version "$agent")" "$took" "$why" \
      "$(sed 's/\x1b\[[0-9;]*m//g' "$SCRATCH/$agent.out" | grep -v '^\s*$' | tail -1 | cut -c1-300)"
  fi
done
echo "outputs in $SCRATCH"
exit $((FAILED > 0))
