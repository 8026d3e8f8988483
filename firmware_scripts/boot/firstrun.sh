#!/bin/bash
# First boot of a Raspberry Pi OS image prepared by flash.sh, started by `systemd.run=` in
# cmdline.txt the way Raspberry Pi Imager customises images (systemd reboots once it exits 0).
# Applies the settings flash.sh left in fedal/settings/ (hostname, Wi-Fi, SSH key), stages the
# agent's installer for the next boot (it needs the network), then removes itself from
# cmdline.txt. Prefers Raspberry Pi OS's own helpers (imager_custom, userconf) where they exist.
# Each setting is a step of its own: one that fails is logged as FAILED and named in
# fedal-firstrun-FAILED.txt at the top of the boot partition (readable from any PC), and the others
# still run. The hook is removed all the same: the same settings would fail again at every boot,
# and a Pi left at kernel-command-line.target has no network and no login to mend it from.
# FEDAL_TARGET_ROOT (tests only) points every write into a staging root.
set -u

BOOT="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
R="${FEDAL_TARGET_ROOT:-}"
S="$BOOT/fedal/settings"
IMAGER=/usr/lib/raspberrypi-sys-mods/imager_custom
USERCONF=/usr/lib/userconf-pi/userconf
exec >>"$BOOT/fedal/firstrun.log" 2>&1
log() { echo "fedal firstrun: $*"; }
setting() { if [ -f "$S/$1" ]; then cat "$S/$1"; fi; }
# shellcheck disable=SC2317  # called from the steps
native() { [ -z "$R" ] && [ -x "$1" ]; }  # Raspberry Pi OS helpers only on the real system
log "started $(date -u +%FT%TZ 2>/dev/null || true)"
rm -f "$BOOT/fedal-firstrun-FAILED.txt"  # an earlier first boot's, on a card flashed again

if [ -f "$BOOT/fedal/firstrun-previous.sh" ]; then
  log "running the firstrun.sh that was on the card before (e.g. Raspberry Pi Imager's)"
  bash "$BOOT/fedal/firstrun-previous.sh" || log "the previous firstrun.sh failed ($?); continuing"
fi

failed=()
# run a setting's step under `set -e` (a subshell, so the first failing command ends only it)
step() {
  local what="$1" rc
  shift
  ( set -e; "$@" )
  rc=$?
  if [ "$rc" -ne 0 ]; then
    log "FAILED: $what (exit $rc); the other settings go on"
    failed+=("$what")
  fi
}

# shellcheck disable=SC2317  # run through step()
set_hostname() {
  if native "$IMAGER"; then
    "$IMAGER" set_hostname "$name"
  else
    echo "$name" >"$R/etc/hostname"
    if grep -q '^127\.0\.1\.1' "$R/etc/hosts" 2>/dev/null; then
      sed -i "s/^127\.0\.1\.1.*/127.0.1.1\t$name/" "$R/etc/hosts"
    else
      printf '127.0.1.1\t%s\n' "$name" >>"$R/etc/hosts"
    fi
  fi
  log "hostname $name"
}
name="$(setting hostname)"
if [ -n "$name" ]; then step hostname set_hostname; fi

# shellcheck disable=SC2317  # run through step()
set_ssh() {
  mapfile -t keys <"$S/authorized_keys"
  if native "$IMAGER"; then
    "$IMAGER" enable_ssh -k "${keys[@]}"  # keys go to the first user, which userconf names below
    if [ -x "$USERCONF" ]; then "$USERCONF" "$user" ''; fi
  else
    if ! grep -q "^$user:" "$R/etc/passwd"; then
      useradd ${R:+--prefix "$R"} --create-home --shell /bin/bash --user-group "$user"
      for g in sudo adm; do
        if grep -q "^$g:" "$R/etc/group"; then usermod ${R:+--prefix "$R"} -aG "$g" "$user"; fi
      done
    fi
    ids="$(awk -F: -v u="$user" '$1 == u { print $3 ":" $4 }' "$R/etc/passwd")"
    home="$(awk -F: -v u="$user" '$1 == u { print $6 }' "$R/etc/passwd")"
    install -d -m 0700 "$R$home/.ssh"
    install -m 0600 "$S/authorized_keys" "$R$home/.ssh/authorized_keys"
    chown "$ids" "$R$home" "$R$home/.ssh" "$R$home/.ssh/authorized_keys"
    install -d "$R/etc/ssh/sshd_config.d" "$R/etc/sudoers.d" "$R/etc/systemd/system/multi-user.target.wants"
    echo "PasswordAuthentication no" >"$R/etc/ssh/sshd_config.d/10-fedal-keys-only.conf"
    printf '%s ALL=(ALL) NOPASSWD: ALL\n' "$user" >"$R/etc/sudoers.d/010_fedal-nopasswd"
    chmod 0440 "$R/etc/sudoers.d/010_fedal-nopasswd"
    ln -sfn /lib/systemd/system/ssh.service "$R/etc/systemd/system/multi-user.target.wants/ssh.service"
  fi
  log "ssh: key login for $user, passwords off"
}
user="$(setting ssh-user)"
if [ -s "$S/authorized_keys" ]; then step ssh set_ssh; fi

# shellcheck disable=SC2317  # run through step()
set_wifi() {
  psk="$(setting wifi-psk)"
  country="$(setting wifi-country)"
  if native "$IMAGER"; then
    "$IMAGER" set_wlan -p "$ssid" "$psk" "$country"
  else
    conn="$R/etc/NetworkManager/system-connections/fedal-wifi.nmconnection"
    install -d -m 0755 "$(dirname "$conn")"
    uuid="$(cat /proc/sys/kernel/random/uuid)"
    {
      printf '[connection]\nid=fedal-wifi\nuuid=%s\ntype=wifi\nautoconnect=true\n\n' "$uuid"
      printf '[wifi]\nmode=infrastructure\nssid=%s\n\n' "$ssid"
      if [ -n "$psk" ]; then printf '[wifi-security]\nkey-mgmt=wpa-psk\npsk=%s\n\n' "$psk"; fi
      printf '[ipv4]\nmethod=auto\n\n[ipv6]\naddr-gen-mode=default\nmethod=auto\n'
    } >"$conn"
    chmod 0600 "$conn"  # NetworkManager ignores connection files others can read
  fi
  # the regulatory domain (cfg80211.ieee80211_regdom=) is already on the kernel command line
  if [ -z "$R" ] && command -v rfkill >/dev/null 2>&1; then rfkill unblock wifi || true; fi
  for f in "$R"/var/lib/systemd/rfkill/*:wlan; do
    if [ -f "$f" ]; then echo 0 >"$f"; fi
  done
  log "wi-fi $ssid ($country)"
}
ssid="$(setting wifi-ssid)"
if [ -n "$ssid" ]; then step wi-fi set_wifi; fi

FEDAL_TARGET_ROOT="$R" bash "$BOOT/fedal/stage.sh" || { log "staging the agent installer failed"; exit 1; }
if [ "${#failed[@]}" -gt 0 ]; then
  {
    echo "The first boot could not apply: ${failed[*]}."
    echo "What each step did is in fedal/firstrun.log on this partition (and /var/log/fedal-firstrun.log)."
    echo "Mend it on the Pi (console or Ethernet), or flash the card again."
  } >"$BOOT/fedal-firstrun-FAILED.txt"
fi

# Done: never again. The settings hold the Wi-Fi passphrase: overwritten before they go, as
# firstboot.sh does with what it removes (a plain delete leaves the bytes on the card)
for f in "$S"/*; do
  if [ -f "$f" ] && [ ! -L "$f" ]; then shred -u -- "$f" 2>/dev/null || rm -f -- "$f"; fi
done
rm -rf "$S"
rm -f "$BOOT/firstrun.sh"
sed -i -e 's/ systemd\.run[^ ]*//g' -e 's/ systemd\.unit=kernel-command-line\.target//g' "$BOOT/cmdline.txt"
if [ "${#failed[@]}" -gt 0 ]; then log "finished with failed steps: ${failed[*]}; rebooting"; else log "finished; rebooting"; fi
if install -d "$R/var/log"; then cp "$BOOT/fedal/firstrun.log" "$R/var/log/fedal-firstrun.log"; fi  # fedal/ goes after the install
exit 0
