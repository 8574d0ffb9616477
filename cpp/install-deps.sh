#!/usr/bin/env bash
# The system packages libspecpilot builds with (Debian / Ubuntu names), installed when missing:
# a C++17 compiler, CMake, pkg-config, nlohmann-json, cpp-httplib (the example server), OpenSSL (SHA-256).
set -euo pipefail
need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
[ -f /usr/include/httplib.h ] || need+=(libcpp-httplib-dev)
[ -f /usr/include/openssl/evp.h ] || need+=(libssl-dev)
[ ${#need[@]} -eq 0 ] && exit 0
echo "cpp/install-deps.sh: installing ${need[*]}"
if [ "$(id -u)" -ne 0 ]; then
  sudo=sudo
  command -v sudo >/dev/null || { echo "cpp/install-deps.sh: need root to install ${need[*]}" >&2; exit 1; }
else
  sudo=
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q >/dev/null || true   # a stale index still serves the packages it lists
$sudo apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
