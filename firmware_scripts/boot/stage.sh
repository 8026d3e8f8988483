#!/bin/bash
# Stages the agent's installation for a boot with network: installs fedal-firstboot.service, which
# runs firstboot.sh (this directory's installer) until it succeeds, and enables it. Runs as root
# on the device: from firstrun.sh (firstrun images) or cloud-init's runcmd (with --start).
# FEDAL_TARGET_ROOT (tests only) points every write into a staging root.
set -eu
HERE="$(cd "$(dirname "$(readlink -f "$0")")" && pwd)"
R="${FEDAL_TARGET_ROOT:-}"
# a card flashed again after an install: this payload is new (its config, its password), so the
# marker of the install before must not keep fedal-firstboot from running (ConditionPathExists)
rm -f "$R/var/lib/fedal-firstboot/done" "$R/var/lib/fedal-agent/.firstboot-done"
install -D -m 0644 "$HERE/fedal-firstboot.service" "$R/etc/systemd/system/fedal-firstboot.service"
install -D -m 0755 "$HERE/firstboot.sh" "$R/usr/local/sbin/fedal-firstboot"
install -d "$R/etc/default"
printf 'FEDAL_PAYLOAD=%s\n' "$HERE" >"$R/etc/default/fedal-firstboot"
install -d "$R/etc/systemd/system/multi-user.target.wants"
ln -sfn /etc/systemd/system/fedal-firstboot.service "$R/etc/systemd/system/multi-user.target.wants/fedal-firstboot.service"
echo "fedal stage: the agent installs at the next boot with network (journalctl -u fedal-firstboot)"
if [ "${1:-}" = --start ] && [ -z "$R" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl start --no-block fedal-firstboot.service
fi
