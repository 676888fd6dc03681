#!/usr/bin/env bash
# System packages the service tests use: promtool (prometheus) to check deploy/prometheus,
# chromium + chromium-driver for the web-page screenshot. Idempotent; never fails CI: without
# apt or network the tests that need these skip and say why.
set -u
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
if [ ${#missing[@]} -eq 0 ]; then
    echo "system-deps: promtool, chromium, chromedriver present"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: no apt-get; missing ${missing[*]} (their tests will skip)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "system-deps: not root and no sudo; missing ${missing[*]} (their tests will skip)"
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 300 $SUDO apt-get update -qq >/dev/null 2>&1 \
    && timeout 900 $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1; then
    echo "system-deps: installed ${missing[*]}"
else
    echo "system-deps: could not install ${missing[*]} (no network?); their tests will skip"
fi
exit 0
