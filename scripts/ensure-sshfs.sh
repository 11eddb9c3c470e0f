#!/usr/bin/env bash
# A real network filesystem on this host, for the store-across-hosts tests: an sshd on a
# loopback port that only kvctl's generated key may log into, which sshfs mounts over.
#
#   bash scripts/ensure-sshfs.sh [STATE_DIR]     (default $KVCTL_HOME/sshfs, ~/.cache/kvctl/sshfs)
#
# Idempotent: installs Debian's openssh-server and sshfs only when missing; generates the
# host and client keys once (STATE_DIR, mode 0700); starts sshd (its own config, pid file
# and log in STATE_DIR, 127.0.0.1 only, public-key login for root, nothing else) only when
# the one it started before is not running. Prints the port on stdout. Mounts are the
# callers' (tests mount with `sshfs -p PORT -o IdentityFile=STATE_DIR/client_key ...` and
# unmount with `fusermount -u`); `--stop` stops the sshd; `--install` only installs the
# packages (make test). Needs root (apt-get, /dev/fuse).
set -euo pipefail

log() { echo "ensure-sshfs: $*" >&2; }

STOP=0
INSTALL_ONLY=0
if [ "${1:-}" = "--stop" ]; then
  STOP=1
  shift
elif [ "${1:-}" = "--install" ]; then
  INSTALL_ONLY=1
  shift
fi
STATE=${1:-${KVCTL_HOME:-$HOME/.cache/kvctl}/sshfs}
PIDFILE=$STATE/sshd.pid
PORTFILE=$STATE/port

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

if [ "$STOP" = 1 ]; then
  if running; then
    kill "$(cat "$PIDFILE")"
    log "stopped sshd $(cat "$PIDFILE")"
  fi
  rm -f "$PIDFILE"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  log "needs root (apt-get, sshd, /dev/fuse)"
  exit 1
fi

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v sshfs >/dev/null 2>&1 || missing+=(sshfs)
command -v ssh-keygen >/dev/null 2>&1 || missing+=(openssh-client)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Another installer (make -j, a second script) may hold dpkg's lock: wait for it.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  # policy-rc.d 101: the package must not start the system's own sshd on port 22.
  had_policy=0
  [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ "$had_policy" = 1 ] || printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" fuse3 >/dev/null
  [ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d
fi
[ -e /dev/fuse ] || { log "/dev/fuse is missing: FUSE is not available here"; exit 1; }
[ "$INSTALL_ONLY" = 0 ] || exit 0

mkdir -p "$STATE"
chmod 700 "$STATE"
[ -f "$STATE/host_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$STATE/host_key"
[ -f "$STATE/client_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$STATE/client_key"
cp "$STATE/client_key.pub" "$STATE/authorized_keys"
chmod 600 "$STATE/authorized_keys"
mkdir -p /run/sshd  # sshd's privilege-separation directory

if running; then
  cat "$PORTFILE"
  exit 0
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$STATE/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $STATE/host_key
PidFile $PIDFILE
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
Subsystem sftp internal-sftp
EOF
/usr/sbin/sshd -f "$STATE/sshd_config" -E "$STATE/sshd.log"
for _ in $(seq 50); do
  running && break
  sleep 0.1
done
running || { log "sshd did not start (log: $STATE/sshd.log)"; exit 1; }
echo "$port" > "$PORTFILE"
log "sshd $(cat "$PIDFILE") on 127.0.0.1:$port (state: $STATE)"
echo "$port"
