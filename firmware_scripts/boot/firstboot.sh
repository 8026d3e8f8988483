#!/bin/bash
# Installs the agent from the payload flash.sh left on the boot partition, then wipes the
# payload (it holds the device's broker password). fedal-firstboot.service runs this at boot,
# after the network, until it succeeds. With a wheelhouse (flash.sh --wheelhouse) the install uses
# no package index, so a failure is not the network's: it is not retried (exit 3, which the unit's
# RestartPreventExitStatus honours) until someone starts the service again.
# FEDAL_TARGET_ROOT (tests only): a staging root.
set -eu
R="${FEDAL_TARGET_ROOT:-}"
P="${FEDAL_PAYLOAD:?FEDAL_PAYLOAD is not set (see /etc/default/fedal-firstboot)}"
log() { echo "fedal firstboot: $*"; }

# the config (it holds the broker password) is kept here from the first attempt on, off the FAT
# partition that anyone holding the card (or any user of the running Pi: vfat has no owners) can
# read, while installs are retried; a reflashed card brings a new one to $P
KEPT="$R/root/.fedal-firstboot"
CONFIG="$P/agent.toml"
if [ ! -f "$CONFIG" ] && [ -d "$P" ] && [ -f "$KEPT/agent.toml" ]; then CONFIG="$KEPT/agent.toml"; fi
if [ ! -f "$CONFIG" ]; then
  log "no agent payload at $P (already installed?)"
  exit 1
fi
# overwritten before it is removed: FAT keeps a removed file's bytes until they are reused
wipe() { shred -u -- "$1" 2>/dev/null || rm -f -- "$1"; }
keep_config_off_the_card() {
  [ "$CONFIG" = "$P/agent.toml" ] || return 0
  install -d -m 0700 "$KEPT"
  install -m 0600 "$P/agent.toml" "$KEPT/agent.toml"
  wipe "$P/agent.toml"
  CONFIG="$KEPT/agent.toml"
  log "the config (with the broker password) moved off the boot partition to ${KEPT#"$R"}/agent.toml"
}
keep_config_off_the_card
WH=""
if [ -f "$P/install-args" ]; then
  WH="$(awk 'prev == "--wheelhouse" { print; exit } { prev = $0 }' "$P/install-args")"
fi
# No real-time clock on a Pi: until NTP has set the clock, TLS to the package index may fail.
# An install from the wheelhouse talks to no index: no need to wait.
if [ -z "$WH" ] && [ -z "$R" ] && command -v timedatectl >/dev/null 2>&1; then
  for _ in $(seq 1 60); do
    [ "$(timedatectl show -p NTPSynchronized --value 2>/dev/null || true)" = yes ] && break
    sleep 5
  done
fi

args=(--config "$CONFIG")
if [ -f "$P/ca.crt" ]; then args+=(--ca "$P/ca.crt"); fi
for f in "$P"/*.whl "$P"/data/*; do
  [ -f "$f" ] || continue
  case "$f" in *.whl) args+=(--wheel "$f") ;; *) args+=(--data "$f") ;; esac
done
if [ -f "$P/install-args" ]; then
  mapfile -t extra <"$P/install-args"
  for ((i = 0; i < ${#extra[@]}; i++)); do
    if [ "${extra[$i]}" = --wheelhouse ]; then i=$((i + 1)); else args+=("${extra[$i]}"); fi
  done
fi
if [ -n "$WH" ]; then
  # on the boot partition it travels with the payload; on the root partition it is where flash.sh put it
  if [ -f "$P/wheelhouse/fedal-wheelhouse.json" ]; then WH="$P/wheelhouse"; else WH="$R$WH"; fi
  args+=(--wheelhouse "$WH")
fi
if [ -n "$R" ]; then args+=(--root "$R"); fi
log "installing the agent$([ -n "$WH" ] && echo " offline, from the wheelhouse $WH"): install-agent.sh ${args[*]}"
rc=0
bash "$P/install-agent.sh" "${args[@]}" || rc=$?
if [ "$rc" -ne 0 ]; then
  if [ "$rc" -eq 3 ] || [ "$rc" -eq 2 ]; then
    log "the installer refused this device's install for good (see above; e.g. a torch its CPU cannot run,"
    log "or a config it cannot use); not retrying: flash the card again with what it names"
    exit 3
  fi
  if [ -n "$WH" ]; then
    log "the offline install from $WH failed (see above); not retrying, it would fail the same way:"
    log "fix the cause, then: systemctl start fedal-firstboot"
    exit 3
  fi
  log "the install failed (see above); retrying in a minute"
  exit 1
fi

# Installed: the private data leaves the FAT partition (anyone holding the card could read it),
# and this service is done for good.
for f in "$P"/data/*; do if [ -f "$f" ]; then wipe "$f"; fi; done
# the card's own first-boot settings that flash.sh replaced and kept in the payload (Raspberry Pi
# Imager's firstrun.sh, the image's user-data, network-config and meta-data) are the card owner's: they stay,
# on the root partition and readable by root only (they may hold a Wi-Fi passphrase)
ORIGINALS="$R/var/lib/fedal-firstboot/card-originals"
for f in firstrun-previous.sh user-data.orig network-config.orig meta-data.orig; do
  [ -f "$P/$f" ] || continue
  install -d -m 0700 "$ORIGINALS"
  dest="$ORIGINALS/$f"  # one kept by an install before (a card flashed again) stays too
  if [ -e "$dest" ] && ! cmp -s "$P/$f" "$dest"; then dest="$dest.$(date +%Y%m%d-%H%M%S)"; fi
  install -m 0600 "$P/$f" "$dest"
  wipe "$P/$f"
  log "a first-boot file of the card's own that flash.sh had replaced ($f) is kept as ${dest#"$R"}"
done
rm -rf "$P" "$KEPT"
# a wheelhouse flash.sh put on the root partition (too big for the boot one): its manifest says it is ours
case "$WH" in /?*) if [ -f "$WH/fedal-wheelhouse.json" ]; then rm -rf -- "$WH"; fi ;; esac
# the marker goes where only root writes: the agent's own directory is its service user's, and a
# touch there as root would follow a link that user put in its place
install -d -m 0755 "$R/var/lib/fedal-firstboot"
: >"$R/var/lib/fedal-firstboot/done"
rm -f "$R/etc/systemd/system/multi-user.target.wants/fedal-firstboot.service"
log "done: journalctl -u fedal-agent -f"
