#!/bin/bash
# Prepare this machine to build and run rlproxy's container images with podman.
# This machine has no container registry, so a local stand-in for python:3.11-slim is built
# from Debian packages. Idempotent: a second run takes a few seconds.
#   tests/deploy/host/setup-host.sh            # then: export CONTAINERS_CONF=tests/deploy/host/containers.conf
# Afterwards build with:  podman build --build-arg BASE_IMAGE=localhost/local/python:3.11-slim ...
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in podman runc debootstrap docker-compose; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
WORK=${WORK:-$(mktemp -d)}
trap 'rm -rf "$WORK"' EXIT
# The Debian mirror this machine's apt already uses.
if [ -z "${MIRROR:-}" ]; then
  MIRROR=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | grep -oE '^(URIs:|deb) +https?://[^ ]+' | awk '{print $2}' | grep -v security | head -n 1 || true)
fi
if ! podman image exists localhost/local/bookworm-min; then
  debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR" >/dev/null
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - localhost/local/bookworm-min
  rm -rf "$WORK/rootfs"
fi
if ! podman image exists localhost/local/python:3.11-slim; then
  # python:3.11-slim look-alike: Debian's python3.11 with pip and venv, no PEP 668 lock, and this
  # machine's extra CA certificates so pip inside a build reaches the package index as the host does.
  ctx="$WORK/pybase"; mkdir -p "$ctx/extra-ca"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/extra-ca/" 2>/dev/null || true
  cat > "$ctx/Containerfile" <<'CF'
FROM localhost/local/bookworm-min
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip python-is-python3 ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
COPY extra-ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
CMD ["python3"]
CF
  podman build -q -t localhost/local/python:3.11-slim "$ctx" >/dev/null
  rm -rf "$ctx"
fi
echo "ready: podman with CONTAINERS_CONF=$CONTAINERS_CONF; base image localhost/local/python:3.11-slim"
