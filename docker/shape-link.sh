#!/bin/sh
# Shape an emulated device's link like its profile's (run by fedge-device-boot at boot, and by
# `fedge emulate fault partition|resume` after the device is reconnected: the engine gives it a new
# interface, which comes without the qdiscs). Idempotent: every qdisc is `tc ... replace`d.
#
# The settings come from the environment `fedge emulate up` sets from the device's profile:
#   FEDGE_UPLINK_KBIT / FEDGE_DOWNLINK_KBIT   sustained rates (tbf)
#   FEDGE_DELAY_MS                            one-way delay on each direction (netem; RTT = 2 x this)
#   FEDGE_LOSS_PCT                            packet loss on each direction (netem)
# Egress is shaped on the fleet interface; its ingress is redirected to an ifb device and shaped there.
set -eu
# The interface of the default route: eth0 at boot; after a partition the engine adds a new one (eth1, ...).
dev=${FEDGE_IFACE:-$(ip -o route show default 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n 1)}
dev=${dev:-eth0}

shape() {  # shape IFACE RATE_KBIT
  # burst: ~1 ms at the rate, at least two MTU-sized packets; latency bounds the queue to 5 s of data.
  # The bucket starts full, so a transfer of B bytes takes (B - burst) / rate: 10 ms of burst let a
  # 1.5 MB update over a 500 Mbit/s link finish 26 % early (benchmarks/emulation.py), 1 ms keeps it to ~4 %.
  burst=$(( $2 * 1000 / 8 / 1000 )); [ "$burst" -lt 3200 ] && burst=3200
  delay=${FEDGE_DELAY_MS:-0}; loss=${FEDGE_LOSS_PCT:-0}
  # netem (delay, loss) at the root and tbf (rate) below it: the classic netem + tbf chain.
  if tc qdisc replace dev "$1" root handle 1: netem delay "${delay}ms" loss "${loss}%" limit 100000 2>/dev/null; then
    tc qdisc replace dev "$1" parent 1:1 handle 10: tbf rate "$2kbit" burst "$burst" latency 5s
  else
    # Some kernels (e.g. minimal VM kernels) are built without sch_netem: keep the rate, say what is lost.
    if [ "$delay" != 0 ] || [ "$loss" != 0 ]; then
      echo "fedge-shape-link: this kernel has no netem qdisc: $1 gets its rate (${2} kbit/s) but not its" \
           "${delay} ms delay or ${loss} % loss" >&2
    fi
    tc qdisc replace dev "$1" root handle 10: tbf rate "$2kbit" burst "$burst" latency 5s
  fi
}

if [ -n "${FEDGE_UPLINK_KBIT:-}${FEDGE_DOWNLINK_KBIT:-}" ] && ! tc qdisc show dev "$dev" >/dev/null 2>&1; then
  # An arm64 device under QEMU user emulation: QEMU does not translate tc's netlink messages
  # ("Cannot talk to rtnetlink: Operation not supported"), so this container cannot shape its link.
  echo "fedge-shape-link: tc cannot talk to the kernel here ($(uname -m) under QEMU user emulation?):" \
       "the link is NOT shaped (uplink ${FEDGE_UPLINK_KBIT:-?} kbit/s, downlink ${FEDGE_DOWNLINK_KBIT:-?}" \
       "kbit/s, ${FEDGE_DELAY_MS:-0} ms delay are not emulated)" >&2
  exit 0
fi
if [ -n "${FEDGE_UPLINK_KBIT:-}" ]; then
  shape "$dev" "$FEDGE_UPLINK_KBIT"
fi
if [ -n "${FEDGE_DOWNLINK_KBIT:-}" ]; then
  ip link add ifb0 type ifb 2>/dev/null || true
  ip link set ifb0 up
  tc qdisc replace dev "$dev" handle ffff: ingress
  tc filter replace dev "$dev" parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect dev ifb0
  shape ifb0 "$FEDGE_DOWNLINK_KBIT"
fi
