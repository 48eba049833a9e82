# An emulated fedge device: Python 3.11, fedge and its dependencies in /opt/fedge/venv, tc for link shaping.
# It boots from a flashed payload mounted at /boot/firmware (see docker/device-boot.sh).
#
# Build context: a directory with wheels/deps/*.whl, wheels/fedge/fedge-*.whl (docker/wheelhouse.sh),
# device-boot.sh and shape-link.sh. Nothing is downloaded while building unless the base image lacks tc (then apt-get fetches
# iproute2: a registry user's python:3.11-slim image has no tc; fedge's debootstrap base has it).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS deps
COPY wheels/deps /tmp/wheels
# Every dependency wheel, in its own stage so the final image holds the venv, not the wheels.
RUN python3 -m venv /opt/fedge/venv \
 && /opt/fedge/venv/bin/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check /tmp/wheels/*.whl

FROM ${BASE_IMAGE}
RUN command -v tc >/dev/null || { apt-get update && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*; }
COPY --from=deps /opt/fedge/venv /opt/fedge/venv
# fedge itself last: a code change rebuilds only this small layer.
COPY wheels/fedge /tmp/fedge
RUN /opt/fedge/venv/bin/pip install --quiet --no-index --no-cache-dir --disable-pip-version-check \
      --find-links /tmp/fedge /tmp/fedge/fedge-*.whl \
 && rm -rf /tmp/fedge \
 && /opt/fedge/venv/bin/python -c "import fedge, torch; print('fedge', fedge.__version__, 'torch', torch.__version__)"
COPY device-boot.sh /usr/local/bin/fedge-device-boot
COPY shape-link.sh /usr/local/bin/fedge-shape-link
ENV PATH=/opt/fedge/venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
ENTRYPOINT ["/bin/sh", "/usr/local/bin/fedge-device-boot"]
