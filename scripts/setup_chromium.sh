#!/usr/bin/env bash
# Make a headless browser available for the viewer's browser tests (tests/viewer/test_browser.py).
#
# Idempotent: skipped when `chromium` is already on PATH (~0 s). On a fresh machine (root + apt) it
# installs Debian's `chromium` package (~1-2 min, ~100 MB download). No browser is ever downloaded by
# Playwright itself: the tests point Playwright at this binary (VERL_AGENT_CHROMIUM, default: `chromium`
# on PATH). Without root/apt it warns and exits 0 -- except in CI (CI=true), where it is a failure;
# the browser tests fail (never skip) when the browser is missing.
set -euo pipefail

fail() {
  echo "setup_chromium: $*" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
  echo "setup_chromium: continuing without chromium (the viewer browser tests will fail)" >&2
  exit 0
}

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    fail "chromium is missing and cannot be installed (need root and apt-get)"
  fi
  echo "setup_chromium: installing chromium"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null \
    || { apt-get update >/dev/null \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-dejavu-core >/dev/null; } \
    || fail "apt-get install chromium failed"
fi
echo "setup_chromium: $(chromium --version 2>/dev/null || echo 'chromium (version unknown)')"
