#!/bin/sh
# fedge device install for @DEVICE_ID@ (fleet @FLEET@), written by `fedge flash`. Idempotent: run it again
# to repair or update an installation; nothing is duplicated, the data folder is never touched.
#
#   sh install.sh [--prefix DIR] [--venv PATH] [--no-systemd]
#
#   --prefix DIR   install under DIR (a scratch root) instead of /; no user is created then
#   --venv PATH    the virtualenv to use (default PREFIX/opt/fedge/venv); if fedge already imports there,
#                  nothing is installed into it
#   --no-systemd   do not install, enable or start fedge-edge.service (containers, tests)
set -eu

HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=/
VENV=
SYSTEMD=1
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#--prefix=}; shift ;;
    --venv) [ $# -ge 2 ] || { echo "install.sh: --venv needs a path" >&2; exit 2; }; VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#--venv=}; shift ;;
    --no-systemd) SYSTEMD=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

mkdir -p "$PREFIX"
ROOT=$(cd "$PREFIX" && pwd)
[ "$ROOT" = / ] && ROOT=
ETC=$ROOT/etc/fedge
STATE=$ROOT/var/lib/fedge
OPT=$ROOT/opt/fedge
[ -n "$VENV" ] || VENV=$OPT/venv
VERSION=@VERSION@
OWN_DATA=@OWN_DATA@
# device: train on the device's own data; sim: a fleet without [data] classes, whose devices rebuild their share
# of the benchmark data set (scikit-learn's digits, ...).
EXTRA=@EXTRA@
say() { echo "fedge install: $*"; }

# 1. A dedicated system account (only for a real root install: a scratch prefix has no users).
OWNER=
if [ -z "$ROOT" ] && [ "$(id -u)" = 0 ]; then
  if ! id -u fedge >/dev/null 2>&1; then
    useradd --system --user-group --home-dir /var/lib/fedge --no-create-home --shell /usr/sbin/nologin fedge
    say "created the system user fedge"
  fi
  OWNER=fedge
fi
own() { [ -z "$OWNER" ] || chown "$OWNER:$OWNER" "$@"; }

# 2. The virtualenv and fedge[$EXTRA]: from the offline wheelhouse when the payload has one, else the index.
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import fedge' 2>/dev/null; then
  have=$("$VENV/bin/python" -c 'import fedge; print(fedge.__version__)')
  say "fedge $have already installed in $VENV (payload: $VERSION): not reinstalling"
else
  command -v python3 >/dev/null || { echo "install.sh: python3 is missing (apt-get install python3-venv)" >&2; exit 3; }
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || {
    echo "install.sh: cannot create a virtualenv at $VENV (apt-get install python3-venv)" >&2; exit 3; }
  if ls "$HERE"/wheels/*.whl >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet --no-index --find-links "$HERE/wheels" "fedge[$EXTRA]==$VERSION"
    say "installed fedge[$EXTRA] $VERSION from the payload's wheelhouse"
  else
    "$VENV/bin/python" -m pip install --quiet "fedge[$EXTRA]==$VERSION"
    say "installed fedge[$EXTRA] $VERSION from the package index"
  fi
fi

# 3. The bundle: configuration readable by the service, secrets 0600.
install -d -m 0755 "$ETC" "$ETC/bundle"
for f in "$HERE"/bundle/*; do
  [ -f "$f" ] || continue
  name=$(basename "$f")
  case "$name" in
    password|*.key) install -m 0600 "$f" "$ETC/bundle/$name"; own "$ETC/bundle/$name" ;;
    *) install -m 0644 "$f" "$ETC/bundle/$name" ;;
  esac
done
if grep -q '^password_file' "$ETC/bundle/bundle.toml" 2>/dev/null && [ ! -f "$ETC/bundle/password" ]; then
  echo "install.sh: the bundle has no password file ($HERE/bundle/password): flash the device again" >&2; exit 4
fi

# 4. The exported model (with --export), the state and data folders.
if [ -d "$HERE/model" ]; then
  rm -rf "$OPT/model.new"
  mkdir -p "$OPT"
  cp -R "$HERE/model" "$OPT/model.new"
  rm -rf "$OPT/model"
  mv "$OPT/model.new" "$OPT/model"
fi
install -d -m 0750 "$STATE" "$STATE/data"
own "$STATE" "$STATE/data"

# 5. The launcher: the agent exactly as the systemd unit starts it.
install -d -m 0755 "$OPT/bin"
DATA_ARGS=
[ "$OWN_DATA" = 1 ] && DATA_ARGS=" --data \"$STATE/data\" --status-file \"$STATE/status.json\""
# A fleet that signs (fleet.pub in the bundle): replay protection across restarts, and over-the-air model
# updates into $STATE/models (fedge deploy), starting from the flashed model.
if [ -f "$ETC/bundle/fleet.pub" ]; then
  DATA_ARGS="$DATA_ARGS --state-dir \"$STATE\" --model-store \"$STATE/models\""
  [ -d "$OPT/model" ] && DATA_ARGS="$DATA_ARGS --model \"$OPT/model\""
fi
cat > "$OPT/bin/fedge-edge.new" <<LAUNCHER
#!/bin/sh
# fedge edge agent of @DEVICE_ID@, written by install.sh (fedge flash). Extra arguments are passed on.
exec "$VENV/bin/fedge" edge run --bundle "$ETC/bundle"$DATA_ARGS "\$@"
LAUNCHER
chmod 0755 "$OPT/bin/fedge-edge.new"
mv "$OPT/bin/fedge-edge.new" "$OPT/bin/fedge-edge"
echo "$VERSION" > "$OPT/installed"

# 6. The systemd unit.
if [ "$SYSTEMD" = 1 ]; then
  install -d -m 0755 "$ROOT/etc/systemd/system"
  install -m 0644 "$HERE/fedge-edge.service" "$ROOT/etc/systemd/system/fedge-edge.service"
  if [ -z "$ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
    systemctl daemon-reload
    systemctl enable fedge-edge.service
    systemctl restart fedge-edge.service
    say "fedge-edge.service enabled and started"
  else
    say "unit installed to $ROOT/etc/systemd/system (systemd not running here: not started)"
  fi
fi
say "done: $OPT/bin/fedge-edge (bundle $ETC/bundle, data $STATE/data)"
