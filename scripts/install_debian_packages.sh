#!/usr/bin/env bash
# Debian packages that some tests need, installed when a command they give is absent and
# apt-get can run as root (as in CI); elsewhere it says why those tests will skip. `make test`
# runs it once per need (Makefile: browser, prometheus). A package's service is not started
# (no init here).
# Usage: scripts/install_debian_packages.sh "WHAT NEEDS THEM" "COMMAND..." PACKAGE...
set -u
purpose=$1 commands=$2
shift 2
absent=0
for name in $commands; do
  command -v "$name" >/dev/null || absent=1
done
[ "$absent" = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: $commands absent and apt-get cannot run as root here; $purpose will skip" \
       "(to run: apt-get install $*)"
  exit 0
fi
echo "installing $* (Debian packages) for $purpose"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
then
  echo "note: installing $* failed (see above); $purpose will skip"
fi
