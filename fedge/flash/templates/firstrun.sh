#!/bin/sh
# fedge-flash first-boot hook for device @DEVICE_ID@ (fleet @FLEET@), written by `fedge flash`.
# Started once by the kernel command line (systemd.run=...firstrun.sh), as Raspberry Pi Imager's firstrun.sh is.
# 1. runs the firstrun.sh that was here before fedge flash (kept as fedge/firstrun.previous.sh), if any;
# 2. enables fedge-install.service, which installs fedge at the next boot, once the network is up;
# 3. removes this hook from cmdline.txt and itself; systemd then reboots (systemd.run_success_action).
BOOT=$(dirname "$(readlink -f "$0")")
ROOT=${FEDGE_FIRSTRUN_ROOT:-}  # tests run the hook against a scratch root; empty on a device
if [ -f "$BOOT/fedge/firstrun.previous.sh" ]; then
  /bin/bash "$BOOT/fedge/firstrun.previous.sh" || echo "fedge: the previous firstrun.sh exited with $?" >&2
fi
UNITS=$ROOT/etc/systemd/system
mkdir -p "$UNITS/multi-user.target.wants"
sed "s|@BOOT@|$BOOT|g" "$BOOT/fedge/fedge-install.service" > "$UNITS/fedge-install.service"
# What `systemctl enable` does for a unit WantedBy=multi-user.target (systemctl may refuse this early in boot).
ln -sf ../fedge-install.service "$UNITS/multi-user.target.wants/fedge-install.service"
rm -f "$BOOT/firstrun.sh"
sed -i -e 's| systemd\.run=[^ ]*||g' -e 's| systemd\.run_success_action=[^ ]*||g' \
  -e 's| systemd\.unit=kernel-command-line\.target||g' "$BOOT/cmdline.txt"
exit 0
