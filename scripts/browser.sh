#!/usr/bin/env bash
# What the browser tests (tests/dashboard/) need, on a Debian machine (idempotent, quiet): Debian's
# Chromium at /usr/bin/chromium. Playwright's Python package comes from the `dev` extra (pip); its own
# browser download (`playwright install`) is never used: the tests launch /usr/bin/chromium.
#
#   bash scripts/browser.sh          # installs chromium with apt-get when /usr/bin/chromium is missing
#
# Installing needs root and apt-get; without them it says what is missing and exits 1.
set -euo pipefail

log() { echo "browser.sh: $*" >&2; }

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  log "/usr/bin/chromium is missing; install Debian's chromium package (as root: apt-get install chromium)"
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log "installing chromium (apt-get) ..."
if ! apt-get install -y -q chromium >/dev/null 2>&1; then
  log "apt-get install failed; updating the package lists and trying again"
  apt-get update -q >/dev/null
  apt-get install -y -q chromium >/dev/null
fi
[ -x /usr/bin/chromium ] || { log "apt-get installed no /usr/bin/chromium"; exit 1; }
log "$(/usr/bin/chromium --version 2>/dev/null || echo chromium installed)"
