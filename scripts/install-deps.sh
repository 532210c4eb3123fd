#!/usr/bin/env bash
# Installs the Debian 12 packages kvevict's build, tests and benchmarks need, if missing.
set -euo pipefail
pkgs=(cmake ninja-build g++ clang lld make libeigen3-dev libfmt-dev nlohmann-json3-dev catch2 libbenchmark-dev
      libfaiss-dev libhwy-dev liblapack-dev libblas-dev libclang-rt-14-dev python3 python3-numpy)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
