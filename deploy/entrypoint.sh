#!/bin/sh
# rlproxy's container entrypoint (run under tini, which forwards SIGTERM and reaps children).
#
#   serve [ARGS]   `rlproxy serve`; on a public bind with no API key in the database yet, first
#                  makes one admin key and writes it to RLPROXY_BOOTSTRAP_KEY_FILE (default
#                  $RLPROXY_DATA_DIR/admin.key, readable by this user only), so a fresh stack
#                  is never open. RLPROXY_BOOTSTRAP_KEY=false skips that: serve then refuses a
#                  public bind until `rlproxy keys create` made a key (or
#                  RLPROXY_INSECURE_NO_AUTH=true says something in front authenticates).
#   train|keys|status|score|export [ARGS]   that `rlproxy` command
#   anything else  run as given (e.g. `sh`)
set -eu

data_dir=${RLPROXY_DATA_DIR:-/data}
key_file=${RLPROXY_BOOTSTRAP_KEY_FILE:-$data_dir/admin.key}

bootstrap_key() {
  case "${RLPROXY_BOOTSTRAP_KEY:-true}" in false|0|no) return 0 ;; esac
  case "${RLPROXY_INSECURE_NO_AUTH:-false}" in true|1|yes) return 0 ;; esac
  case "${RLPROXY_HOST:-127.0.0.1}" in 127.*|localhost|::1) return 0 ;; esac
  # Made on an earlier start. (Should its key be gone from the database, serve still refuses a
  # public bind with no key: this only saves the database look-up on every start.)
  [ -s "$key_file" ] && return 0
  listing=$(rlproxy keys list)
  case "$listing" in
    "no API keys"*) ;;
    *) return 0 ;;
  esac
  (umask 077 && rlproxy keys create --name bootstrap-admin --scope admin > "$key_file.tmp")
  mv "$key_file.tmp" "$key_file"
  echo "rlproxy-entrypoint: no API key existed; created an admin key in $key_file" \
       "(read it with: docker compose exec rlproxy cat $key_file)." \
       "Make inference keys with it or with \`rlproxy keys create\`." >&2
}

cmd=${1:-serve}
[ $# -gt 0 ] && shift
case "$cmd" in
  serve)
    mkdir -p "$data_dir"
    bootstrap_key
    exec rlproxy serve "$@"
    ;;
  train|keys|status|score|export)
    exec rlproxy "$cmd" "$@"
    ;;
  *)
    exec "$cmd" "$@"
    ;;
esac
