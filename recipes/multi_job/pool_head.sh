# Sourced by the multi_job recipes: a private Ray head for the jobs of one machine, unless RAY_ADDRESS names a
# running cluster.  `ray start --head --block` runs in its own session, and stop_head ends exactly that process
# group (never `ray stop`, which would stop every Ray on the machine).
start_head() {  # $1: logical CPUs of the head (each CPU job's worker takes 2)
  if [ -n "${RAY_ADDRESS:-}" ]; then HEAD_PID=""; return; fi
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}  # a private head; a token in ~/.ray would otherwise switch auth on
  local port; port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  HEAD_TMP=$(mktemp -d /tmp/mjray.XXXXXX)  # short: Ray's socket paths must stay under 107 bytes
  setsid python -m ray.scripts.scripts start --head --block --port="$port" --num-cpus="$1" --temp-dir="$HEAD_TMP" --include-dashboard=false \
      --disable-usage-stats > "$OUT/ray_head.log" 2>&1 &
  HEAD_PID=$!
  disown "$HEAD_PID"
  for _ in $(seq 120); do
    python -c "import socket; socket.create_connection(('127.0.0.1', $port), timeout=1)" 2>/dev/null && break
    sleep 0.5
  done
  sleep 2
  export RAY_ADDRESS=127.0.0.1:$port
  echo "private Ray head at $RAY_ADDRESS (log: $OUT/ray_head.log)"
}

stop_head() {
  [ -n "${HEAD_PID:-}" ] || return 0
  kill -TERM -- "-$HEAD_PID" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$HEAD_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$HEAD_PID" 2>/dev/null || true
  rm -rf "$HEAD_TMP"
}
