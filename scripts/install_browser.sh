#!/usr/bin/env bash
# Debian's headless Chromium and its matching chromedriver, for the browser test of `lab ui`
# (tests/test_ui.py). Idempotent: does nothing when both are installed. Uses the system's own apt
# sources, so Selenium never has to download a browser or driver itself.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    echo "chromium and chromedriver already installed: $(/usr/bin/chromium --version 2>/dev/null | head -n1)"
    exit 0
fi

bash "$(dirname "$0")/apt_install.sh" chromium chromium-driver
echo "installed: $(/usr/bin/chromium --version 2>/dev/null | head -n1)"
