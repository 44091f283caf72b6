#!/usr/bin/env bash
# A private sshd on 127.0.0.1 and 127.0.0.2, so that the deepspeed runner can launch a real
# two-"node" job over ssh/pdsh on one machine (tests/dist/test_multinode.py).
#
#   scripts/loopback_sshd.sh up   DIR        start it (keys, config, known_hosts, pid files all in DIR)
#   scripts/loopback_sshd.sh stop DIR ADDR   stop the one serving ADDR, by its pid (a "node" lost)
#   scripts/loopback_sshd.sh down DIR        stop them BY THEIR PIDS and remove DIR
#
# One sshd per address (the same port on each), so that one "node" can go away alone.
# Nothing outside DIR is touched (not /etc/ssh, not ~/.ssh), except /run/sshd, which sshd needs and
# which is removed again if this script created it. After `up`, DIR/bin holds an `ssh` wrapper that
# uses DIR/ssh_config: put DIR/bin first on PATH and both the runner's ssh check and pdsh use it.
# Needs openssh-server and pdsh (.ci/run installs them) and root (sshd only logs in as the owner).
set -euo pipefail

cmd=${1:?usage: loopback_sshd.sh up|stop|down DIR [ADDR]}
DIR=${2:?usage: loopback_sshd.sh up|stop|down DIR [ADDR]}
ADDRS="127.0.0.1 127.0.0.2"
SSHD=${SSHD:-/usr/sbin/sshd}
CFG=$DIR/sshd_config  # one per address: $CFG.$ADDR, pid file $DIR/sshd.$ADDR.pid

ours() {  # the pid is alive and is an sshd started with one of our configs
  local pid=${1:-}
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' </proc/"$pid"/cmdline | grep -q -- "-f $CFG."
}

stop_pidfile() {
  local f=$1 pid
  [[ -f $f ]] || return 0
  pid=$(cat "$f")
  if ours "$pid"; then
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  return 0
}

if [[ $cmd == stop ]]; then
  addr=${3:?usage: loopback_sshd.sh stop DIR ADDR}
  stop_pidfile "$DIR/sshd.$addr.pid"
  stop_pidfile "$DIR/sshd.$addr.pid.launch"
  exit 0
fi

if [[ $cmd == down ]]; then
  for a in $ADDRS; do
    stop_pidfile "$DIR/sshd.$a.pid"
    stop_pidfile "$DIR/sshd.$a.pid.launch"
  done
  if [[ -f $DIR/.created_run_sshd ]] && ! pgrep -x sshd >/dev/null; then rmdir /run/sshd 2>/dev/null || true; fi
  rm -rf -- "$DIR"
  exit 0
fi

[[ $cmd == up ]] || { echo "usage: loopback_sshd.sh up|stop|down DIR [ADDR]" >&2; exit 2; }
for b in "$SSHD" ssh ssh-keygen pdsh; do
  command -v "$b" >/dev/null || { echo "loopback_sshd: $b is missing (apt-get install openssh-server pdsh)" >&2; exit 3; }
done
mkdir -p "$DIR/bin"
chmod 700 "$DIR"
if [[ -f $DIR/sshd.127.0.0.1.pid ]] && ours "$(cat "$DIR/sshd.127.0.0.1.pid")"; then
  echo "loopback_sshd: already running (pid $(cat "$DIR/sshd.127.0.0.1.pid"))"
  exit 0
fi
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ssh-keygen -q -t ed25519 -N '' -C loopback-host -f "$DIR/host_key"
ssh-keygen -q -t ed25519 -N '' -C loopback-client -f "$DIR/id_ed25519"
cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
chmod 600 "$DIR/authorized_keys"
if [[ ! -d /run/sshd ]]; then mkdir -p -m 0755 /run/sshd && touch "$DIR/.created_run_sshd"; fi
for a in $ADDRS; do
{
  echo "Port $PORT"
  echo "ListenAddress $a"
  echo "HostKey $DIR/host_key"
  echo "PidFile $DIR/sshd.$a.pid"
  echo "AuthorizedKeysFile $DIR/authorized_keys"
  cat <<'EOF'
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
X11Forwarding no
AllowTcpForwarding no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
MaxSessions 100
EOF
} >"$CFG.$a"
"$SSHD" -t -f "$CFG.$a"
setsid "$SSHD" -D -f "$CFG.$a" -E "$DIR/sshd.$a.log" </dev/null >/dev/null 2>&1 &
echo $! >"$DIR/sshd.$a.pid.launch"
for _ in $(seq 50); do [[ -s $DIR/sshd.$a.pid ]] && break; sleep 0.1; done
[[ -s $DIR/sshd.$a.pid ]] || cp "$DIR/sshd.$a.pid.launch" "$DIR/sshd.$a.pid"
done

hostkey=$(cut -d' ' -f1,2 "$DIR/host_key.pub")
: >"$DIR/known_hosts"
for a in $ADDRS; do echo "[$a]:$PORT $hostkey" >>"$DIR/known_hosts"; done
cat >"$DIR/ssh_config" <<EOF
Host $ADDRS
  Port $PORT
  User $(id -un)
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $DIR/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
EOF
printf '#!/bin/sh\nexec %s -F %s "$@"\n' "$(command -v ssh)" "$DIR/ssh_config" >"$DIR/bin/ssh"
chmod 755 "$DIR/bin/ssh"
for a in $ADDRS; do
  "$DIR/bin/ssh" "$a" true || { echo "loopback_sshd: ssh to $a failed; see $DIR/sshd.$a.log" >&2; exit 1; }
done
echo "loopback_sshd: sshd pids $(cat "$DIR"/sshd.*.pid | tr '\n' ' ')on $ADDRS port $PORT; put $DIR/bin first on PATH"
