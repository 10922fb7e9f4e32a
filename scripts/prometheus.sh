#!/usr/bin/env bash
# Install Prometheus (the `prometheus` server and `promtool`) from Debian's package when either is
# missing. Used by CI before the dashboard/alert tests; safe to run again (does nothing then).
#
# The package's maintainer scripts would start a system service: we never want one (the tests
# start the binary themselves on a free port), so a policy-rc.d that refuses every start is put in
# place for the install and removed afterwards, only if this script created it.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  echo "prometheus.sh: $(promtool --version 2>&1 | head -n1) already installed"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "prometheus.sh: apt-get not found; install Prometheus 2.x (prometheus and promtool) by hand" >&2
  exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  SUDO="sudo"
fi

POLICY=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\n# added by proxima scripts/prometheus.sh: start no service during install\nexit 101\n' \
    | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod 755 "$POLICY"
  created_policy=1
fi
cleanup() {
  if [ "$created_policy" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
  fi
}
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null

# Belt and braces: if some init system started it anyway, stop that service (ours run unmanaged).
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

command -v prometheus >/dev/null && command -v promtool >/dev/null
echo "prometheus.sh: installed $(promtool --version 2>&1 | head -n1)"
