# Mosquitto for a fedge fleet. The config `fedge broker config` writes (mosquitto.conf, passwd, acl, tls/,
# data/) is mounted at run time at the same absolute path it was written to, because the config names its
# files by absolute path; so passwords never end up in an image layer.
#   docker run -v "$PWD/broker:$PWD/broker" fedge-broker -c "$PWD/broker/mosquitto.conf"
# BASE_IMAGE: any image with /usr/sbin/mosquitto (eclipse-mosquitto:2 from a registry, or fedge's
# debootstrap base, which installs Debian's mosquitto 2.0).
ARG BASE_IMAGE=eclipse-mosquitto:2
FROM ${BASE_IMAGE}
ENTRYPOINT ["/usr/sbin/mosquitto"]
