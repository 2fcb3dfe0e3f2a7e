#!/usr/bin/env bash
# A local PostgreSQL server (Debian's package) for the multi-worker tests and for trying a study across
# workers on one machine: a private cluster of its own (not the system's), bound to 127.0.0.1 only,
# with a role `lab` and the databases lab_optuna (Optuna's RDB storage) and lab_mlflow (the backend
# store of an `mlflow server`, see `lab server`).
#
#   scripts/postgres.sh install   apt-get install postgresql (needs root or passwordless sudo; idempotent)
#   scripts/postgres.sh start     create the cluster on first use, start it, print the base URL
#   scripts/postgres.sh stop      stop it (the data stays)
#   scripts/postgres.sh status    exit 0 if it runs
#   scripts/postgres.sh url       print the base URL, e.g. postgresql://lab:lab@127.0.0.1:55432
#
# Settings (environment): LAB_PG_PORT (55432), LAB_PG_DIR (${TMPDIR:-/tmp}/lab-postgres-PORT),
# LAB_PG_PASSWORD (lab), LAB_PG_HOST (127.0.0.1: the address it listens on).
set -euo pipefail

PORT=${LAB_PG_PORT:-55432}
HOST=${LAB_PG_HOST:-127.0.0.1}
DIR=${LAB_PG_DIR:-${TMPDIR:-/tmp}/lab-postgres-$PORT}
PASSWORD=${LAB_PG_PASSWORD:-lab}
DATABASES=(lab_optuna lab_mlflow)

bindir() {
    local ctl
    ctl=$(ls -d /usr/lib/postgresql/*/bin/pg_ctl 2>/dev/null | sort -V | tail -n1 || true)
    [[ -n $ctl ]] || ctl=$(command -v pg_ctl || true)
    [[ -n $ctl ]] || { echo "postgres.sh: no PostgreSQL server found; run: scripts/postgres.sh install" >&2; exit 1; }
    dirname "$ctl"
}

# initdb refuses to run as root: as root, the cluster belongs to Debian's `postgres` user
as_owner() {
    if [[ $(id -u) -eq 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

url() { echo "postgresql://lab:$PASSWORD@$HOST:$PORT"; }

psql_lab() { PGPASSWORD=$PASSWORD psql -h "$HOST" -p "$PORT" -U lab -d postgres -v ON_ERROR_STOP=1 -qtA "$@"; }

running() { [[ -f $DIR/postmaster.pid ]] && as_owner "$(bindir)/pg_ctl" -D "$DIR" status >/dev/null 2>&1; }

case ${1:-start} in
install)
    if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null; then
        echo "PostgreSQL server already installed: $(ls -d /usr/lib/postgresql/*/ 2>/dev/null | tr '\n' ' ')"
        exit 0
    fi
    # Debian may also create (and, outside containers, start) its own cluster on 5432: never used here
    bash "$(dirname "$0")/apt_install.sh" postgresql
    echo "installed: $(ls -d /usr/lib/postgresql/*/bin | tr '\n' ' ')"
    ;;
start)
    BIN=$(bindir)
    if [[ ! -f $DIR/PG_VERSION ]]; then
        mkdir -p "$DIR"
        [[ $(id -u) -eq 0 ]] && chown postgres:postgres "$DIR"
        chmod 700 "$DIR"
        pwfile=$(mktemp)
        echo "$PASSWORD" >"$pwfile"
        chmod 644 "$pwfile"
        as_owner "$BIN/initdb" -D "$DIR" -U lab --pwfile="$pwfile" --auth-host=scram-sha-256 \
            --auth-local=trust -E UTF8 >"$DIR.initdb.log" 2>&1 ||
            { cat "$DIR.initdb.log" >&2; rm -f "$pwfile"; exit 1; }
        rm -f "$pwfile"
    fi
    if ! running; then
        as_owner "$BIN/pg_ctl" -D "$DIR" -l "$DIR/server.log" -w -t 60 \
            -o "-c listen_addresses=$HOST -p $PORT -c unix_socket_directories=$DIR -c max_connections=200" \
            start >/dev/null || { tail -n 20 "$DIR/server.log" >&2; exit 1; }
    fi
    for db in "${DATABASES[@]}"; do
        [[ $(psql_lab -c "SELECT 1 FROM pg_database WHERE datname = '$db'") == 1 ]] ||
            psql_lab -c "CREATE DATABASE $db"
    done
    url
    ;;
stop)
    if running; then as_owner "$(bindir)/pg_ctl" -D "$DIR" -m fast -w stop >/dev/null; fi
    ;;
status)
    running
    ;;
url)
    url
    ;;
*)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
