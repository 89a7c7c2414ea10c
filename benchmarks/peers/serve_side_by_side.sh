#!/usr/bin/env bash
# Serving, kvpilot against vLLM, measured by vLLM's own load generator (`vllm bench serve`):
# each server in turn on the same cores (taskset), same model folder, same served name; for
# each, a burst of N prompts and a Poisson rate; ROUNDS rounds, alternating servers.
#
#   benchmarks/peers/serve_side_by_side.sh            # 2 rounds, cores 0-1, 16 prompts
#   CORES=0 THREADS=1 ROUNDS=1 benchmarks/peers/serve_side_by_side.sh
#   SERVERS="vllm kvpilot kvpilot-thread" benchmarks/peers/serve_side_by_side.sh
#
# SERVERS: vllm; kvpilot (its engine core in a process of its own, the default);
# kvpilot-thread (`--no-engine-core-process`: the engine core on a thread of the API's process).
# KVPILOT_ARGS: more flags for kvpilot's server (e.g. "--max-num-batched-tokens 512").
# TEMPERATURE: the requests' temperature (e.g. 0 for greedy); unset, `vllm bench serve` sends
# none and each server samples at its default.
# Prints vLLM bench's own report per run; JSON results under $OUT (default /tmp/serve-bench).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CORES=${CORES:-0-1}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
PROMPTS=${PROMPTS:-16}
RATE=${RATE:-2}
OUT=${OUT:-/tmp/serve-bench}
SERVERS=${SERVERS:-vllm kvpilot}
TEMPERATURE=${TEMPERATURE:-}
VLLM_PY=$("$REPO/benchmarks/peers/install-vllm.sh" | tail -1)
MODEL=$("$REPO/.venv/bin/python" -c "from kvpilot.engine.model_loader import resolve_model; print(resolve_model(None))")
NAME=smollm2
mkdir -p "$OUT"
cd "$OUT"  # never the repository: its operator/ folder shadows the standard library's

wait_ready() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on $1 did not become ready" >&2
  return 1
}

start_server() {  # name port -> pid
  if [[ $1 == vllm ]]; then
    OMP_NUM_THREADS=$THREADS VLLM_CPU_OMP_THREADS_BIND=$CORES VLLM_CPU_KVCACHE_SPACE=2 \
      setsid taskset -c "$CORES" "$VLLM_PY" -I "$REPO/benchmarks/peers/vllm_cli.py" serve "$MODEL" \
      --served-model-name "$NAME" --dtype float32 --max-model-len 2048 --host 127.0.0.1 \
      --port "$2" --seed 0 > "$OUT/$1.log" 2>&1 &
  else
    local mode=()
    [[ $1 == kvpilot-thread ]] && mode=(--no-engine-core-process)
    read -ra extra <<< "${KVPILOT_ARGS:-}"
    KVPILOT_NUM_THREADS=$THREADS OMP_NUM_THREADS=$THREADS \
      setsid taskset -c "$CORES" "$REPO/.venv/bin/kvpilot" serve --model "$MODEL" \
      --served-model-name "$NAME" --max-model-len 2048 --host 127.0.0.1 --port "$2" \
      "${mode[@]}" "${extra[@]}" > "$OUT/$1.log" 2>&1 &
  fi
  echo $!
}

bench() {  # label port rate
  # The load generator runs outside the servers' cores where there are any (else beside them).
  "$VLLM_PY" -I "$REPO/benchmarks/peers/vllm_cli.py" bench serve --backend openai \
    --base-url "http://127.0.0.1:$2" --endpoint /v1/completions --model "$NAME" \
    --tokenizer "$MODEL" --dataset-name random --random-input-len 128 --random-output-len 32 \
    --num-prompts "$PROMPTS" --request-rate "$3" --ignore-eos --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    ${TEMPERATURE:+--temperature "$TEMPERATURE"} \
    --save-result --result-dir "$OUT" --result-filename "$1.json" 2>&1 \
    | sed -n '/Serving Benchmark Result/,/^=\+$/p'
}

echo "machine: $(nproc) cores, $(uname -sr); cores $CORES, $THREADS threads; $PROMPTS prompts 128 in / 32 out"
for round in $(seq "$ROUNDS"); do
  for server in $SERVERS; do
    port=$([[ $server == vllm ]] && echo 8100 || echo 8101)
    pid=$(start_server "$server" "$port")
    wait_ready "$port"
    for rate in inf "$RATE"; do
      echo "=== round $round, $server, rate $rate, load $(cut -d' ' -f1 /proc/loadavg)"
      bench "$server-r$round-rate$rate" "$port" "$rate"
    done
    kill -- "-$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 1; done
    sleep 10  # let the load average settle
  done
done
