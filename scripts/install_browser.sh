#!/usr/bin/env bash
# Debian's headless Chromium and its matching chromedriver, for the browser test of `lab ui`
# (tests/test_ui.py). Idempotent: does nothing when both are installed. Uses the system's own apt
# sources, so Selenium never has to download a browser or driver itself.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    echo "chromium and chromedriver already installed: $(/usr/bin/chromium --version 2>/dev/null | head -n1)"
    exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
    sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    echo "install_browser.sh: needs root or passwordless sudo to apt-get install chromium chromium-driver" >&2
    exit 1
fi

$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
echo "installed: $(/usr/bin/chromium --version 2>/dev/null | head -n1)"
