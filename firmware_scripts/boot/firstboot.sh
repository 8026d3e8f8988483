#!/bin/bash
# Installs the agent from the payload flash.sh left on the boot partition, then wipes the
# payload (it holds the device's broker password). fedal-firstboot.service runs this at boot,
# after the network, until it succeeds. FEDAL_TARGET_ROOT (tests only): a staging root.
set -eu
R="${FEDAL_TARGET_ROOT:-}"
P="${FEDAL_PAYLOAD:?FEDAL_PAYLOAD is not set (see /etc/default/fedal-firstboot)}"
log() { echo "fedal firstboot: $*"; }

if [ ! -f "$P/agent.toml" ]; then
  log "no agent payload at $P (already installed?)"
  exit 1
fi
# No real-time clock on a Pi: until NTP has set the clock, TLS to the package index may fail.
if [ -z "$R" ] && command -v timedatectl >/dev/null 2>&1; then
  for _ in $(seq 1 60); do
    [ "$(timedatectl show -p NTPSynchronized --value 2>/dev/null || true)" = yes ] && break
    sleep 5
  done
fi

args=(--config "$P/agent.toml")
if [ -f "$P/ca.crt" ]; then args+=(--ca "$P/ca.crt"); fi
for f in "$P"/*.whl "$P"/data/*; do
  [ -f "$f" ] || continue
  case "$f" in *.whl) args+=(--wheel "$f") ;; *) args+=(--data "$f") ;; esac
done
if [ -f "$P/install-args" ]; then
  mapfile -t extra <"$P/install-args"
  args+=("${extra[@]}")
fi
if [ -n "$R" ]; then args+=(--root "$R"); fi
log "installing the agent: install-agent.sh ${args[*]}"
bash "$P/install-agent.sh" "${args[@]}"

# Installed: the credentials leave the FAT partition (anyone holding the card could read them),
# and this service is done for good.
rm -rf "$P"
install -d "$R/var/lib/fedal-agent"
touch "$R/var/lib/fedal-agent/.firstboot-done"
rm -f "$R/etc/systemd/system/multi-user.target.wants/fedal-firstboot.service"
log "done: journalctl -u fedal-agent -f"
