#!/usr/bin/env bash
# apt-get install the given Debian packages, as root or through passwordless sudo (the system's own apt
# sources: nothing is downloaded from elsewhere). Used by install_browser.sh and postgres.sh.
set -euo pipefail

if [[ $(id -u) -eq 0 ]]; then
    sudo=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
else
    echo "apt_install.sh: needs root or passwordless sudo to apt-get install $*" >&2
    exit 1
fi

$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
