#!/usr/bin/env bash
# Prometheus and promtool from Debian's packages (bookworm: 2.42), for the monitoring tests
# (tests/test_deploy_monitoring.py: `promtool check rules` and `promtool test rules` on what
# `qvl-trt deploy --monitoring` writes) and scripts/render_dashboard.py. `make test` runs
# this first: it installs them when absent and apt-get can run as root (as in CI); elsewhere
# it says why those tests will skip. The package's service is not started (no init here).
set -u
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: promtool is absent and apt-get cannot run as root here; the monitoring" \
       "tests will skip (to run them: apt-get install prometheus)"
  exit 0
fi
echo "installing prometheus (Debian package, with promtool) for the monitoring tests"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus \
       >/dev/null; }; then
  echo "note: installing prometheus failed (see above); the monitoring tests will skip"
fi
