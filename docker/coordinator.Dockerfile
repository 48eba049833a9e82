# The fedge coordinator: the device image's Python environment (same layers, no extra size) with the
# coordinator service as its command. Build the device image first (fedge emulate up does).
ARG DEVICE_IMAGE=fedge-device:amd64
FROM ${DEVICE_IMAGE}
ENTRYPOINT ["/opt/fedge/venv/bin/fedge", "coordinator", "run"]
