#!/usr/bin/env bash
# Chromium and its WebDriver from Debian's packages, for the chat page's browser test
# (tests/test_gateway_page.py). `make test` runs this first: it installs them when they are
# absent and apt-get can run as root (as in CI); elsewhere it says why that test will skip.
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: chromium and chromedriver are absent and apt-get cannot run as root here; the" \
       "chat page's browser test will skip (to run it: apt-get install chromium chromium-driver)"
  exit 0
fi
echo "installing chromium and chromium-driver (Debian packages) for the chat page's browser test"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium \
       chromium-driver fonts-dejavu-core >/dev/null; }; then
  echo "note: installing chromium failed (see above); the chat page's browser test will skip"
fi
