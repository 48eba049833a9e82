#!/bin/sh
# Boot an emulated device: shape its link like its profile's, install the flashed payload, start the agent.
#
# The flashed payload (fedge flash --to DIR) is mounted read-only at /boot/firmware. The link is shaped from
# the environment `fedge emulate up` sets from the device's profile by fedge-shape-link (docker/shape-link.sh).
set -eu
sh /usr/local/bin/fedge-shape-link

boot=/boot/firmware/fedge
if [ ! -f "$boot/install.sh" ]; then
  echo "fedge-device-boot: no flashed payload at $boot (mount DIR/devices/ID at /boot/firmware)" >&2
  exit 78
fi
sh "$boot/install.sh" --no-systemd --venv /opt/fedge/venv
exec /opt/fedge/bin/fedge-edge "$@"
