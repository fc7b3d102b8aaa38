#!/usr/bin/env bash
# compose.yaml run by podman and podman-compose, on a machine with no Docker engine and,
# possibly, no image registry. `./dev compose up` and `./dev compose down` call this;
# docs/DEPLOY.md ("Without Docker, or without a registry") says what each step does and why.
#
#   deploy/podman/stack.sh up [podman-compose up options]
#       the base images (pulled, or else stand-ins made from Debian packages, reused
#       while their recipe is unchanged), iop:local from the Dockerfile, then the stack
#       in the background; returns once the load balancer answers GET /readyz
#   deploy/podman/stack.sh down
#       stops the stack and removes its containers, pods, networks and volumes
#   deploy/podman/stack.sh images
#       only the images
#
# Environment: IOP_COMPOSE_PROJECT (the compose project, default iop), IOP_COMPOSE_PORT
# (the load balancer's port on 127.0.0.1, default 8080; IOP_COMPOSE_PROMETHEUS_PORT,
# default 9090, Prometheus' in the monitoring profile), IOP_COMPOSE_UP_TIMEOUT (seconds
# `up` waits for the load balancer, default 300), PODMAN_COMPOSE (the podman-compose
# command; `./dev compose` installs one), CONTAINERS_CONF (default
# deploy/podman/containers.conf).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/deploy/podman
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
PROJECT=${IOP_COMPOSE_PROJECT:-iop}
export IOP_COMPOSE_PORT=${IOP_COMPOSE_PORT:-8080}
UP_TIMEOUT=${IOP_COMPOSE_UP_TIMEOUT:-300}
# Logs, the lock, each running project's files (removed by `down`); outside the checkout,
# so that fresh clones share it, like the images.
STATE=${IOP_COMPOSE_STATE:-/var/tmp/iop-compose}
# Bump when a stand-in recipe changes in a way its inputs below do not show.
RECIPE_VERSION=1

# A stand-in's root file system while it is made: removed however the script ends.
ROOTFS=
trap '[ -z "$ROOTFS" ] || rm -rf "$ROOTFS"' EXIT

say() { echo "compose: $*" >&2; }
die() { say "$*"; exit 1; }

podman_compose() {
  local cmd=${PODMAN_COMPOSE:-podman-compose}
  command -v "${cmd%% *}" >/dev/null 2>&1 || die "no podman-compose (run it as ./dev compose, which installs one)"
  # shellcheck disable=SC2086  # PODMAN_COMPOSE may carry arguments
  # podman-compose leaves a value tagged !override uninterpolated: fill the port in here.
  local override=$STATE/$PROJECT/compose.podman.yaml
  mkdir -p "$STATE/$PROJECT"
  sed -e "s/\${IOP_COMPOSE_PORT:-8080}/$IOP_COMPOSE_PORT/g" \
      -e "s/\${IOP_COMPOSE_PROMETHEUS_PORT:-9090}/${IOP_COMPOSE_PROMETHEUS_PORT:-9090}/g" \
      "$HERE/compose.podman.yaml" >"$override"
  (cd "$ROOT" && $cmd -p "$PROJECT" -f compose.yaml -f "$override" "$@")
}

# The Debian mirror apt uses here (its first source that is not -security or -updates).
debian_mirror() {
  local uri
  uri=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null |
        awk '$2 !~ /-/ && $1 ~ /^https?:/ {print $1; exit}')
  echo "${uri:-http://deb.debian.org/debian/}"
}

# ---------------------------------------------------------------- stand-in images
# Each is a Debian minbase root file system with a few packages, imported under the
# official image's name so that compose.yaml and the Dockerfile need no change. Its
# recipe (suite, packages, the customise function, the files it copies) is hashed
# into the label iop.standin.recipe; a stand-in whose label matches is reused.

customise_python() {  # python:3.11-slim: Debian bookworm's Python is 3.11
  local dir=$1
  CHANGES=('ENV LANG=C.UTF-8' 'CMD ["python3"]')
  chroot "$dir" python -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
}

customise_redis() {  # redis:7: Debian bookworm's redis-server is 7.0
  local dir=$1
  install -m 0755 "$HERE/standins/redis-entrypoint.sh" "$dir/usr/local/bin/docker-entrypoint.sh"
  mkdir -p "$dir/data"
  chroot "$dir" chown redis:redis /data
  CHANGES=('WORKDIR /data' 'VOLUME /data' 'USER redis' 'EXPOSE 6379'
           'ENTRYPOINT ["docker-entrypoint.sh"]' 'CMD ["redis-server"]')
  chroot "$dir" redis-server --version | grep -q ' v=7\.' || die "the redis stand-in is not Redis 7"
}

customise_nginx() {  # nginx:1.28-alpine: deploy/nginx.conf needs >= 1.27.3, bookworm has 1.22
  local dir=$1 version
  # The official image's worker user (deploy/nginx.conf: `user nginx;`) and its log
  # files linked to the container's output.
  chroot "$dir" useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin nginx
  ln -sf /dev/stdout "$dir/var/log/nginx/access.log"
  ln -sf /dev/stderr "$dir/var/log/nginx/error.log"
  rm -f "$dir/etc/nginx/sites-enabled/default"
  version=$(chroot "$dir" nginx -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')
  [ "$(printf '%s\n' 1.27.3 "$version" | sort -V | head -n1)" = 1.27.3 ] ||
    die "the nginx stand-in is nginx $version; deploy/nginx.conf needs 1.27.3 or newer"
  CHANGES=('EXPOSE 80' 'STOPSIGNAL SIGQUIT' 'CMD ["nginx", "-g", "daemon off;"]')
}

customise_prometheus() {  # prom/prometheus:v3.5.0: Debian unstable's prometheus is 3.5
  local dir=$1
  mkdir -p "$dir/prometheus"
  chroot "$dir" chown nobody:nogroup /prometheus
  CHANGES=('WORKDIR /prometheus' 'VOLUME /prometheus' 'USER nobody' 'EXPOSE 9090'
           'ENTRYPOINT ["/usr/bin/prometheus"]'
           'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]')
  chroot "$dir" prometheus --version 2>&1 | grep -q 'version 3\.' || die "the prometheus stand-in is not Prometheus 3"
}

# tag suite packages customise
STANDINS=(
  "docker.io/library/python:3.11-slim|bookworm|python3,python3-venv,python3-pip,python-is-python3,ca-certificates|customise_python"
  "docker.io/library/redis:7|bookworm|redis-server,redis-tools|customise_redis"
  # Debian unstable: the first Debian suite with nginx >= 1.27.3
  "docker.io/library/nginx:1.28-alpine|sid|nginx,wget|customise_nginx"
)
MONITORING_STANDINS=(
  "docker.io/prom/prometheus:v3.5.0|sid|prometheus,wget|customise_prometheus"
)
GRAFANA=docker.io/grafana/grafana:11.6.1

recipe_of() {  # suite packages customise
  { printf '%s\n' "$RECIPE_VERSION" "$1" "$2"; declare -f "$3"; cat "$HERE"/standins/*; } | sha256sum | cut -c1-16
}

label_of() {  # image -> its stand-in recipe, "real" for an image from a registry, "" when absent
  podman image exists "$1" 2>/dev/null || { echo ""; return; }
  local label
  label=$(podman image inspect --format '{{index .Labels "iop.standin.recipe"}}' "$1" 2>/dev/null || true)
  case "$label" in ""|"<no value>") echo real ;; *) echo "$label" ;; esac
}

make_standin() {  # tag suite packages customise recipe
  local tag=$1 suite=$2 packages=$3 customise=$4 recipe=$5 dir log started change
  local args=()
  mkdir -p "$STATE"
  dir=$(mktemp -d "$STATE/rootfs.XXXXXX")
  ROOTFS=$dir
  log=$STATE/${customise#customise_}.log
  started=$SECONDS
  say "making the stand-in $tag from Debian $suite ($packages; log in $log)"
  debootstrap --variant=minbase --include="$packages" "$suite" "$dir" "$(debian_mirror)" >"$log" 2>&1 ||
    die "debootstrap of $suite failed (see $log)"
  CHANGES=()
  "$customise" "$dir"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/tmp/* "$dir"/var/log/*.log
  for change in "${CHANGES[@]}" "LABEL iop.standin.recipe=$recipe" "LABEL iop.standin.from=debian-$suite"; do
    args+=(--change "$change")
  done
  tar -C "$dir" --numeric-owner -c . | podman import --quiet "${args[@]}" - "$tag" >/dev/null
  rm -rf "$dir"
  ROOTFS=
  say "$tag made in $((SECONDS - started)) s"
}

ensure_image() {  # "tag|suite|packages|customise"
  local tag suite packages customise recipe have
  IFS='|' read -r tag suite packages customise <<<"$1"
  recipe=$(recipe_of "$suite" "$packages" "$customise")
  have=$(label_of "$tag")
  [ "$have" = real ] || [ "$have" = "$recipe" ] && return 0
  if [ -z "$have" ] && podman pull --quiet "$tag" >/dev/null 2>&1; then
    say "pulled $tag"
    return 0
  fi
  command -v debootstrap >/dev/null 2>&1 || die "no registry gives $tag, and debootstrap is missing (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "no registry gives $tag, and debootstrap needs root to make a stand-in"
  make_standin "$tag" "$suite" "$packages" "$customise" "$recipe"
}

# ---------------------------------------------------------------- iop:local
# The machine's pip settings, handed to the Dockerfile's build stage as the secrets
# pip.conf and pip-cert: the index pip uses here (index-url, http(s) extra-index-url,
# trusted-host, timeout) and its CA bundle. Local paths (find-links, file:// indexes,
# constraints) mean nothing inside the build and are left out.
write_pip_settings() {  # dir -> writes dir/pip.conf and, when pip has a cert, dir/pip-cert
  local dir=$1 python
  python=$(command -v python3 || command -v python)
  "$python" - "$dir" <<'EOF'
import ast, shutil, subprocess, sys
from pathlib import Path

out = Path(sys.argv[1])
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
env: dict[str, str] = {}
files: dict[str, str] = {}
for line in listed.splitlines():
    key, sep, raw = line.partition("=")
    if not sep:
        continue
    section, _, name = key.rpartition(".")
    value = ast.literal_eval(raw)
    if section == ":env:":
        env[name] = value
    elif section == "install" or (section == "global" and name not in files):
        files[name] = value
setting = {**files, **env}
lines = ["[global]"]
for name in ("index-url", "trusted-host", "timeout", "default-timeout", "retries"):
    if setting.get(name):
        lines.append(f"{name} = {setting[name]}")
extra = [u for u in setting.get("extra-index-url", "").split() if u.startswith(("http://", "https://"))]
if extra:
    lines.append("extra-index-url = " + " ".join(extra))
cert = setting.get("cert")
if cert and Path(cert).is_file():
    shutil.copyfile(cert, out / "pip-cert")
    lines.append("cert = /run/secrets/pip-cert")
(out / "pip.conf").write_text("\n".join(lines) + "\n")
EOF
}

build_iop() {
  local tmp started secrets previous
  tmp=$(mktemp -d)
  write_pip_settings "$tmp"
  secrets=(--secret "id=pip.conf,src=$tmp/pip.conf")
  [ -f "$tmp/pip-cert" ] && secrets+=(--secret "id=pip-cert,src=$tmp/pip-cert")
  mkdir -p "$STATE"
  previous=$(podman image inspect --format '{{.Id}}' iop:local 2>/dev/null || true)
  started=$SECONDS
  say "building iop:local from the Dockerfile (log in $STATE/build.log)"
  if ! (cd "$ROOT" && podman build --layers --tag iop:local "${secrets[@]}" --file Dockerfile .) >"$STATE/build.log" 2>&1; then
    rm -rf "$tmp"
    tail -n 20 "$STATE/build.log" >&2
    die "building iop:local failed (see $STATE/build.log)"
  fi
  rm -rf "$tmp"
  # The image the tag leaves behind, unless containers still run from it.
  [ -z "$previous" ] || [ "$previous" = "$(podman image inspect --format '{{.Id}}' iop:local)" ] ||
    podman rmi "$previous" >/dev/null 2>&1 || true
  say "iop:local built in $((SECONDS - started)) s"
}

images() {
  local spec
  command -v podman >/dev/null 2>&1 || die "no podman (apt-get install podman runc)"
  # One maker at a time on a machine: stand-ins and iop:local are shared by every checkout.
  mkdir -p "$STATE"
  exec 9>"$STATE/images.lock"
  flock 9
  for spec in "${STANDINS[@]}"; do
    ensure_image "$spec"
  done
  if [ -n "${COMPOSE_PROFILES:-}" ] && [[ ",$COMPOSE_PROFILES," == *,monitoring,* ]]; then
    for spec in "${MONITORING_STANDINS[@]}"; do
      ensure_image "$spec"
    done
    # Grafana is in no Debian suite: no stand-in for it.
    if ! podman image exists "$GRAFANA" && ! podman pull --quiet "$GRAFANA" >/dev/null 2>&1; then
      say "no registry gives $GRAFANA, and Debian packages no Grafana: name the services to start" \
          "(COMPOSE_PROFILES=monitoring ./dev compose up prometheus)"
    fi
  fi
  build_iop
  flock -u 9
}

# ---------------------------------------------------------------- up, down

up() {
  local deadline url="http://127.0.0.1:$IOP_COMPOSE_PORT/readyz" started=$SECONDS
  images
  mkdir -p "$STATE/$PROJECT"
  say "starting project $PROJECT (podman-compose up -d; the load balancer on 127.0.0.1:$IOP_COMPOSE_PORT)"
  podman_compose up --detach --no-build "$@" >"$STATE/$PROJECT/up.log" 2>&1 ||
    { tail -n 20 "$STATE/$PROJECT/up.log" >&2; die "podman-compose up failed (see $STATE/$PROJECT/up.log)"; }
  # From here: the images may have taken many minutes, the stack itself should not.
  deadline=$((SECONDS + UP_TIMEOUT))
  until python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=3)' "$url" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      podman ps -a --filter "label=io.podman.compose.project=$PROJECT" --format '{{.Names}} {{.Status}}' >&2
      die "the load balancer did not answer $url within ${UP_TIMEOUT} s"
    fi
    sleep 1
  done
  say "up: $url answers ($((SECONDS - started)) s)"
}

down() {
  local kind ids kept="" started=$SECONDS
  mkdir -p "$STATE/$PROJECT"
  if command -v "${PODMAN_COMPOSE:-podman-compose}" >/dev/null 2>&1; then
    podman_compose down --volumes --remove-orphans >"$STATE/$PROJECT/down.log" 2>&1 || {
      kept=1
      say "podman-compose down failed (see $STATE/$PROJECT/down.log); removing what is left by label"
    }
  fi
  # Whatever podman-compose left (a half-made stack, containers of services it no longer
  # knows), found by the label it gives everything of the project.
  ids=$(podman ps -aq --filter "label=io.podman.compose.project=$PROJECT")
  [ -z "$ids" ] || podman rm --force --time 5 $ids >/dev/null
  ids=$(podman pod ps -q --filter "name=^pod_$PROJECT\$")
  [ -z "$ids" ] || podman pod rm --force $ids >/dev/null
  for kind in network volume; do
    ids=$(podman "$kind" ls -q --filter "label=io.podman.compose.project=$PROJECT")
    [ -z "$ids" ] || podman "$kind" rm --force $ids >/dev/null
  done
  [ -n "$kept" ] || rm -rf "${STATE:?}/$PROJECT"
  say "down: project $PROJECT removed ($((SECONDS - started)) s)"
}

mkdir -p "$STATE"
case "${1:-}" in
  up) shift; up "$@" ;;
  down) shift; down ;;
  images) shift; images ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
