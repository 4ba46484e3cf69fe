#!/usr/bin/env bash
# Install redis-server for the state-store tests; a no-op when it is already on PATH.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

# Use sudo only when not already root (CI containers usually run as root).
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
command -v redis-server >/dev/null
