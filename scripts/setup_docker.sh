#!/usr/bin/env bash
# Make Docker usable for the sandbox tests: install, start dockerd, build the runner image offline.
#
# Idempotent: each step is skipped when already done (a warm machine takes ~1 s). On a fresh machine
# (root + apt) it installs docker.io/debootstrap/bubblewrap, plus docker-compose (Debian's 1.29.2)
# unless the `docker compose` plugin is there, starts dockerd in the background and builds the
# runner image with `python -m verl_agent.sandbox.cli build-image` (~1-2 min).
# Without root/apt/Docker it warns and exits 0 (the docker tests then skip) -- except in CI
# (CI=true), where a missing Docker is a failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
LOG="${DOCKERD_LOG:-/tmp/verl-agent-dockerd.log}"

fail() {
  echo "setup_docker: $*" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "setup_docker: continuing without Docker (docker tests will be skipped)" >&2
  exit 0
}

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need_pkgs+=(bubblewrap)
# `verl-agent sandbox up/down`: the compose plugin where present, else Debian's docker-compose
if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
  need_pkgs+=(docker-compose)
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    fail "missing ${need_pkgs[*]} and cannot install them (need root and apt-get)"
  fi
  echo "setup_docker: installing ${need_pkgs[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y "${need_pkgs[@]}" >/dev/null \
    || { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y "${need_pkgs[@]}" >/dev/null; } \
    || fail "apt-get install ${need_pkgs[*]} failed"
fi

if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || fail "dockerd is not running and only root can start it"
  echo "setup_docker: starting dockerd (log: $LOG)"
  nohup dockerd >"$LOG" 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not answer within 60 s (see $LOG)"
fi

if ! docker image inspect verl-agent-sandbox-runner:latest >/dev/null 2>&1; then
  echo "setup_docker: building the runner image offline (debootstrap + docker import, ~1-2 min)"
  (cd "$ROOT" && "$PYTHON" -m verl_agent.sandbox.cli build-image) || fail "building the runner image failed"
fi
(cd "$ROOT" && "$PYTHON" -m verl_agent.tasks.bases >/dev/null) || fail "building the task base images (debian:bookworm-slim, python:3.12-slim) failed"
echo "setup_docker: docker ready ($(docker version --format '{{.Server.Version}}'))"
