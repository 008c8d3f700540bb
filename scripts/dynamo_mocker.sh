#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1 (frontend + 4 mocker workers at ~0 engine time) on loopback, as the `external` side of
# `kvmesh bench frontend --url` (docs/frontend.md). Not part of kvmesh: Dynamo lives in its own venv.
#
#   python3.11 -m venv /tmp/dyn-venv && /tmp/dyn-venv/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
#   echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/dyn-venv/lib/python3.11/site-packages/zz-deps.pth
#   scripts/dynamo_mocker.sh start round-robin 8790     # or kv; prints ROLE=PID lines for --url-pids
#   scripts/dynamo_mocker.sh stop
#
# etcd, nats-server and the mocker run in one new session (as `kvmesh serve --detach` runs kvmesh's workers, etcd and
# nats: a session is a scheduler autogroup), the frontend in the caller's session (as the bench runs kvmesh's
# frontends). The mocker's output tokens are random ids outside tiny-llama's 384-token vocabulary, which detokenise
# to nothing (no content chunk, so no TTFT); a response-replay table gives every request carrying the annotation
# output_replay_id:bench (--url-extra-body) MAX_TOKENS ids of ASCII text instead.
# env: DYN_VENV (/tmp/dyn-venv), MODEL_DIR (models/tiny-llama), D (work dir, /tmp/dyn/run), EP/NP (etcd/nats ports)
set -euo pipefail
cmd=${1:?usage: dynamo_mocker.sh start MODE PORT [MAX_TOKENS] | stop}
D=${D:-/tmp/dyn/run}
if [ "$cmd" = stop ]; then
    [ -f "$D/pids" ] || exit 0
    for kv in $(tac "$D/pids"); do kill -TERM "${kv#*=}" 2>/dev/null || true; done
    for _ in $(seq 50); do
        alive=0; for kv in $(cat "$D/pids"); do kill -0 "${kv#*=}" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && exit 0; sleep 0.2
    done
    for kv in $(cat "$D/pids"); do kill -KILL "${kv#*=}" 2>/dev/null || true; done
    exit 0
fi
MODE=${2:-round-robin}; PORT=${3:-8790}; MAX_TOKENS=${4:-64}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DYN_VENV=${DYN_VENV:-/tmp/dyn-venv}; MODEL_DIR=${MODEL_DIR:-$ROOT/models/tiny-llama}
EP=${EP:-23791}; NP=${NP:-24231}
rm -rf "$D"; mkdir -p "$D"
python - "$MODEL_DIR/tokenizer.json" "$MAX_TOKENS" > "$D/replay.jsonl" <<'PY'
import json, sys
from tokenizers import Tokenizer
ids = Tokenizer.from_file(sys.argv[1]).encode("the quick brown fox jumps over the lazy dog ", add_special_tokens=False).ids
n = int(sys.argv[2])
out = (ids * (n // len(ids) + 1))[:n]
print(json.dumps({"request_id": "bench", "output_length": n, "output_token_ids": out}))
PY
export ETCD_ENDPOINTS=http://127.0.0.1:$EP NATS_SERVER=nats://127.0.0.1:$NP
# Loopback only: Dynamo's TCP request/response planes and event plane otherwise bind the machine's address.
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
export DYN_SYSTEM_HOST=127.0.0.1
export D EP NP DYN_VENV MODEL_DIR NATS_BIN=${NATS_BIN:-nats-server}
setsid bash -c '
  etcd --name dyn --data-dir "$D/etcd" --listen-client-urls http://127.0.0.1:$EP \
       --advertise-client-urls http://127.0.0.1:$EP --listen-peer-urls http://127.0.0.1:$((EP+1)) \
       --initial-advertise-peer-urls http://127.0.0.1:$((EP+1)) --initial-cluster dyn=http://127.0.0.1:$((EP+1)) \
       > "$D/etcd.log" 2>&1 &
  echo "etcd=$!" > "$D/pids.tmp"
  "$NATS_BIN" -a 127.0.0.1 -p $NP -js -sd "$D/nats" > "$D/nats.log" 2>&1 &
  echo "nats=$!" >> "$D/pids.tmp"
  until (exec 3<>/dev/tcp/127.0.0.1/$EP) 2>/dev/null && (exec 3<>/dev/tcp/127.0.0.1/$NP) 2>/dev/null; do sleep 0.2; done
  # --speedup-ratio 0 is documented as infinite, but 1.6.1 runs it at ~6 ms a token; 100000 is ~0 engine time.
  "$DYN_VENV/bin/python" -m dynamo.mocker --model-path "$MODEL_DIR" --model-name tiny-llama --num-workers 4 \
      --speedup-ratio 100000 --block-size 16 --num-gpu-blocks-override 16384 --max-model-len 2048 \
      --event-plane nats --response-replay-trace-path "$D/replay.jsonl" > "$D/mocker.log" 2>&1 &
  echo "workers=$!" >> "$D/pids.tmp"
  mv "$D/pids.tmp" "$D/pids"
' < /dev/null
until [ -f "$D/pids" ]; do sleep 0.2; done
"$DYN_VENV/bin/python" -m dynamo.frontend --http-host 127.0.0.1 --http-port "$PORT" --router-mode "$MODE" \
    --event-plane nats > "$D/frontend.log" 2>&1 &
echo "frontend=$!" >> "$D/pids"
for _ in $(seq 600); do
    curl -sf -m 2 "http://127.0.0.1:$PORT/v1/models" | grep -q tiny-llama && { cat "$D/pids"; exit 0; }
    sleep 0.5
done
echo "Dynamo's frontend did not list tiny-llama in 300 s; logs in $D" >&2
exit 1
