#!/bin/sh
# First start: initdb with POSTGRES_USER as superuser (password POSTGRES_PASSWORD, required),
# create POSTGRES_DB; then run the server as PID 1 (SIGINT: fast shutdown), as the official
# image does.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
mkdir -p "$PGDATA" /run/postgresql
chown -R postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
as_pg() { setpriv --reuid=postgres --regid=postgres --init-groups "$@"; }
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp) && printf '%s' "$POSTGRES_PASSWORD" > "$pwfile" && chown postgres "$pwfile"
  as_pg initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  # Unix socket only while the database is made, so pg_isready on TCP says "not yet".
  as_pg pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  if [ "$db" != postgres ]; then
    as_pg psql -v ON_ERROR_STOP=1 -U "$user" -d postgres -c "CREATE DATABASE \"$db\"" >/dev/null
  fi
  as_pg pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
  postgres -D "$PGDATA" -c listen_addresses='*'
