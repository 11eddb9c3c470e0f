#!/usr/bin/env bash
# FUSE for the hung-store tests (a passthrough filesystem whose daemon they stop):
# Debian's fuse3 (fusermount3) and libfuse3. Installed once; a second run returns at once.
set -euo pipefail
if command -v fusermount3 >/dev/null && ldconfig -p | grep -q 'libfuse3\.so\.3'; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "ensure-fuse: fuse3 is missing and installing it needs root (apt-get install fuse3 libfuse3-3)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends fuse3 libfuse3-3 >/dev/null
echo "ensure-fuse: installed fuse3 and libfuse3"
