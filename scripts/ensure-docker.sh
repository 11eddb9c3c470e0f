#!/usr/bin/env bash
# Make a Docker engine answer on /var/run/docker.sock (CI and fresh machines).
#
# Idempotent: installs Debian's docker.io (engine 20.10, with /usr/bin/docker
# matching it) and mmdebstrap (which makes the local base image without a
# registry) only when missing; starts dockerd in the background only when
# nothing answers on the socket; then waits for the socket. dockerd's log goes
# to /var/log/kvctl-dockerd.log (or $KVCTL_HOME/dockerd.log when /var/log is
# not writable). Needs root, as the engine does.
set -euo pipefail

SOCK=/var/run/docker.sock
WAIT_S=${KVCTL_DOCKERD_WAIT_S:-60}
DOCKER=/usr/bin/docker  # the client that matches the engine (a newer one may be in /usr/local/bin)

log() { echo "ensure-docker: $*" >&2; }

answers() { [ -S "$SOCK" ] && timeout 5 "$DOCKER" -H "unix://$SOCK" version >/dev/null 2>&1; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
[ -x "$DOCKER" ] || missing+=(docker.io)
command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Another installer (make -j, a second script) may hold dpkg's lock: wait for it.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" iptables ca-certificates
fi

if answers; then
  log "dockerd already answers on $SOCK"
  exit 0
fi

if [ -w /var/log ]; then
  LOG=/var/log/kvctl-dockerd.log
else
  LOG=${KVCTL_HOME:-$HOME/.cache/kvctl}/dockerd.log
  mkdir -p "$(dirname "$LOG")"
fi
# A socket left by a dead dockerd makes the new one refuse to start.
if [ -S "$SOCK" ] && ! pgrep -x dockerd >/dev/null 2>&1; then
  rm -f "$SOCK"
fi
if ! pgrep -x dockerd >/dev/null 2>&1; then
  log "starting dockerd (log: $LOG)"
  # setsid + nohup: dockerd outlives this script and the CI step that ran it.
  setsid nohup dockerd --host "unix://$SOCK" >>"$LOG" 2>&1 </dev/null &
fi
for _ in $(seq 1 "$((WAIT_S * 2))"); do
  if answers; then
    log "dockerd answers on $SOCK ($("$DOCKER" -H "unix://$SOCK" version --format '{{.Server.Version}}'))"
    exit 0
  fi
  sleep 0.5
done
log "dockerd did not answer on $SOCK within ${WAIT_S}s; last lines of $LOG:"
tail -n 30 "$LOG" >&2 || true
exit 1
