#!/usr/bin/env bash
# Run a torchrun job across two "hosts" on this machine: two network namespaces joined
# by a veth pair, each with its own hostname and its own /dev/shm (root only).
#
#   sudo scripts/multihost.sh                                  # DDP check: tests/multihost/worker.py train
#   sudo scripts/multihost.sh --rate 1gbit --delay 0.5ms -- examples/quickstart.py
#   sudo scripts/multihost.sh --nproc-per-node 1 -- my_train.py --epochs 1
#
# Options: --nproc-per-node N (2), --rate R and --delay D (netem on both directions of
# the link, e.g. 100mbit / 1ms; default unshaped), --timeout S (300), --subnet A.B.C
# (10.213.7: hosts are .1 and .2; the subnet exists only inside the two namespaces),
# --python P (.venv/bin/python if present, else python3).
#
# Each side runs `torchrun --nnodes=2 --rdzv-backend=c10d` inside
# `ip netns exec NS unshare --uts --mount` with a fresh tmpfs on /dev/shm. The three
# pitfalls in docs/multihost.md are handled: --rdzv-conf=is_host=1/0 (both namespaces would
# otherwise claim the store), GLOO_SOCKET_IFNAME=<veth> (gloo would bind 127.0.0.1), and
# the private hostname + /dev/shm (so shared memory cannot carry cross-host traffic).
# The namespaces and every process in them are removed on exit, also on errors and ^C.
set -euo pipefail

cd "$(dirname "$0")/.."
NPROC=2 RATE="" DELAY="" TIMEOUT=300 SUBNET=10.213.7 PY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc-per-node) NPROC=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --subnet) SUBNET=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then set -- tests/multihost/worker.py train; fi
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
[[ $(id -u) -eq 0 ]] || { echo "multihost.sh: needs root (ip netns, unshare --mount)" >&2; exit 2; }

TAG=$$
NS=("grmh${TAG}a" "grmh${TAG}b")
VETH=("grv${TAG}a" "grv${TAG}b")
ADDR=("${SUBNET}.1" "${SUBNET}.2")
PIDS=()

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]:-}"; do [[ -n "$pid" ]] && kill -KILL "$pid" 2>/dev/null || true; done
  for ns in "${NS[@]}"; do
    for _ in 1 2 3; do   # bounded: whatever still runs inside is ours
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [[ -z "$pids" ]] && break
      kill -KILL $pids 2>/dev/null || true
      sleep 0.2
    done
    ip netns del "$ns" 2>/dev/null || true
  done
  exit "$rc"
}
trap cleanup EXIT INT TERM

for i in 0 1; do ip netns add "${NS[$i]}"; done
ip link add "${VETH[0]}" type veth peer name "${VETH[1]}"
for i in 0 1; do
  ip link set "${VETH[$i]}" netns "${NS[$i]}"
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${VETH[$i]}"
  ip -n "${NS[$i]}" link set "${VETH[$i]}" up
  ip -n "${NS[$i]}" link set lo up
  if [[ -n "$RATE$DELAY" ]]; then
    if ! ip netns exec "${NS[$i]}" tc qdisc replace dev "${VETH[$i]}" root netem \
        ${DELAY:+delay $DELAY} ${RATE:+rate $RATE} limit 100000 2>/dev/null; then
      # No sch_netem in this kernel: a token bucket gives the rate, nothing gives the delay.
      [[ -n "$RATE" ]] || { echo "multihost.sh: no netem here, cannot add a delay" >&2; exit 2; }
      [[ -z "$DELAY" ]] || echo "multihost.sh: no netem in this kernel; delay $DELAY not applied" >&2
      ip netns exec "${NS[$i]}" tc qdisc replace dev "${VETH[$i]}" root tbf rate "$RATE" \
        burst 128kb latency 50ms
    fi
  fi
done
echo "multihost: ${NS[0]} ${ADDR[0]} <-> ${NS[1]} ${ADDR[1]} (${RATE:-unshaped}${DELAY:+, delay $DELAY}), $NPROC rank(s) per host: $*"

RDZV_ID="gradring-$TAG"
for i in 0 1; do
  is_host=$(( i == 0 ? 1 : 0 ))
  (
    GLOO_SOCKET_IFNAME="${VETH[$i]}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -k 10 "$TIMEOUT" ip netns exec "${NS[$i]}" \
      unshare --uts --mount --propagation private sh -c \
        'hostname "$0" && mount -t tmpfs -o size=2g gradring-shm /dev/shm && exec "$@"' \
        "gradring-host$i" "$PY" -m torch.distributed.run --nnodes=2 --nproc-per-node="$NPROC" \
        --rdzv-backend=c10d --rdzv-endpoint="${ADDR[0]}:29431" --rdzv-id="$RDZV_ID" \
        --rdzv-conf=is_host=$is_host --local-addr="${ADDR[$i]}" --max-restarts=0 "$@" \
        2>&1 | sed -u "s/^/[host$i] /"
    exit "${PIPESTATUS[0]}"
  ) &
  PIDS+=("$!")
done

status=0
for pid in "${PIDS[@]}"; do wait "$pid" || status=$?; done
echo "multihost: done (exit $status)"
exit "$status"
