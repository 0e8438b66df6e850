#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests (idempotent): prints its URL, alone, on stdout.
#
#   export GPUFORGE_TEST_POSTGRES_URL=$(bash scripts/postgres.sh)   # start (or reuse) it
#   bash scripts/postgres.sh stop                                    # stop it (the files stay for reuse)
#
# Installs the server binaries with apt-get when none are found (as root; PG_BIN=<dir> names others),
# makes a cluster in $GPUFORGE_PG_DIR (default /tmp/gpuforge-pg-<owner>) owned by a non-root user (as
# root: `postgres`, or a `gpuforge-pg` user made for it), starts it on 127.0.0.1 only, on port
# $GPUFORGE_PG_PORT (default 55432, or the next free one), with trust authentication and no fsync: test
# data only. A second run finds it running and reuses it. The database is `gpuforge`, user `postgres`.
set -euo pipefail

log() { echo "postgres.sh: $*" >&2; }

# --- the server binaries -------------------------------------------------------------------------
find_bin() {
  if [ -n "${PG_BIN:-}" ]; then
    echo "$PG_BIN"
    return
  fi
  local newest
  newest=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$newest" ] && [ -x "$newest/initdb" ]; then
    echo "$newest"
  elif command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
    dirname "$(command -v initdb)"
  fi
}

BIN=$(find_bin)
if [ -z "$BIN" ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    log "no PostgreSQL server binaries found; install them (e.g. apt-get install postgresql) or set PG_BIN"
    exit 1
  fi
  log "installing PostgreSQL (apt-get) ..."
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends postgresql >&2
  BIN=$(find_bin)
  [ -n "$BIN" ] || { log "apt-get installed no initdb"; exit 1; }
fi

# --- a non-root owner ----------------------------------------------------------------------------
if [ "$(id -u)" -eq 0 ]; then
  OWNER=postgres
  if ! id "$OWNER" >/dev/null 2>&1; then
    OWNER=gpuforge-pg
    id "$OWNER" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$OWNER"
  fi
else
  OWNER=$(id -un)
fi

PGDIR=${GPUFORGE_PG_DIR:-${TMPDIR:-/tmp}/gpuforge-pg-$OWNER}
DATA=$PGDIR/data
mkdir -p "$PGDIR"
[ "$(id -u)" -ne 0 ] || chown "$OWNER" "$PGDIR"
chmod 700 "$PGDIR"

as_owner() {  # run a command as the cluster's owner, from a directory it can read
  if [ "$(id -u)" -eq 0 ]; then
    (cd "$PGDIR" && runuser -u "$OWNER" -- "$@")
  else
    (cd "$PGDIR" && "$@")
  fi
}

exec 9>"$PGDIR/.lock"  # two runs at once: the second waits, then finds the server running
flock 9

running_port() {  # the port of the server running on $DATA, or nothing
  if as_owner "$BIN/pg_ctl" status -D "$DATA" >/dev/null 2>&1; then
    sed -n 4p "$DATA/postmaster.pid"
  fi
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if [ "${1:-start}" = stop ]; then
  if [ -n "$(running_port)" ]; then
    as_owner "$BIN/pg_ctl" stop -D "$DATA" -m fast -w >&2
  else
    log "not running"
  fi
  exit 0
fi

# --- the cluster and its server ------------------------------------------------------------------
if [ ! -f "$DATA/PG_VERSION" ]; then
  log "initdb $DATA ($OWNER, $BIN)"
  rm -rf "$DATA"
  as_owner "$BIN/initdb" -D "$DATA" -U postgres -A trust -E UTF8 --locale=C --no-sync >/dev/null
  cat >>"$DATA/postgresql.conf" <<EOF

# gpuforge test cluster (scripts/postgres.sh): loopback only, no durability needed
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PGDIR'
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
EOF
fi

PORT=$(running_port)
if [ -n "$PORT" ]; then
  log "running already on 127.0.0.1:$PORT ($DATA)"
else
  PORT=${GPUFORGE_PG_PORT:-55432}
  for _ in $(seq 100); do
    port_busy "$PORT" || break
    PORT=$((PORT + 1))
  done
  port_busy "$PORT" && { log "no free port near ${GPUFORGE_PG_PORT:-55432}"; exit 1; }
  log "starting on 127.0.0.1:$PORT ($DATA, log $PGDIR/server.log)"
  # 9>&-: the server must not inherit (and so hold forever) the lock
  as_owner "$BIN/pg_ctl" start -D "$DATA" -l "$PGDIR/server.log" -w -t 60 -o "-p $PORT" >/dev/null 9>&- \
    || { tail -n 20 "$PGDIR/server.log" >&2; exit 1; }
fi

PSQL=("$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -v ON_ERROR_STOP=1 -XqtA)
if [ "$("${PSQL[@]}" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = 'gpuforge'")" != 1 ]; then
  "${PSQL[@]}" -d postgres -c "CREATE DATABASE gpuforge" >/dev/null
fi
echo "postgresql+psycopg://postgres@127.0.0.1:$PORT/gpuforge"
