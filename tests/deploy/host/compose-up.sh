#!/bin/bash
# Run `docker-compose ARGS...` against podman on this machine, with healthchecks that work.
# podman 4.3 here has no `podman compose`, and without systemd it never runs healthchecks by
# itself, so `depends_on: condition: service_healthy` would wait forever. This script serves
# podman's Docker-compatible socket, drives the healthchecks once a second, runs docker-compose
# with DOCKER_HOST pointing at the socket, and stops both helpers when it exits.
#   tests/deploy/host/compose-up.sh -f deploy/compose.yaml up -d
#   tests/deploy/host/compose-up.sh -f deploy/compose.yaml down -t 0
# For a test that needs the stack to stay up across several commands, use `serve` instead:
#   eval "$(tests/deploy/host/compose-up.sh serve)"   # exports DOCKER_HOST, prints PIDs to kill
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
sock=${PODMAN_SOCK:-${TMPDIR:-/tmp}/rlproxy-podman.sock}
start_helpers() {
  if [ ! -S "$sock" ]; then
    podman system service --time=0 "unix://$sock" >/dev/null 2>&1 & svc=$!
  else
    svc=""
  fi
  ( while sleep 1; do
      for c in $(podman ps -q --filter health=starting --filter health=unhealthy --filter health=healthy); do
        podman healthcheck run "$c" >/dev/null 2>&1 || true
      done
    done ) >/dev/null 2>&1 & hl=$!
  for _ in $(seq 40); do [ -S "$sock" ] && break; sleep 0.25; done
}
if [ "${1:-}" = serve ]; then
  start_helpers
  echo "export DOCKER_HOST=unix://$sock CONTAINERS_CONF=$CONTAINERS_CONF; # helper pids: $svc $hl"
  echo "RLPROXY_COMPOSE_HELPER_PIDS='$svc $hl'"
  exit 0
fi
start_helpers
trap 'kill $hl ${svc:-} 2>/dev/null || true' EXIT
DOCKER_HOST=unix://$sock docker-compose "$@"
