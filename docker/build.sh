#!/usr/bin/env bash
# Build the dinomo container image on a machine with Docker but no container registry.
#
#   bash docker/build.sh            # dinomo-base, dinomo-builder (if missing), then dinomo:latest
#   bash docker/build.sh --help
#   bash docker/build.sh --tool PATH/Cargo.toml    # only compile that crate (inside the repo)
#                              # with the same builder and cache; prints its release directory
#                              # (tests/compose/run.sh builds dinomo-history this way)
#
# Steps (docker/README.md explains the choices):
#   1. dinomo-base:bookworm    debootstrap --variant=minbase bookworm + rdma-core's user space
#                              (libibverbs1 librdmacm1 ibverbs-providers rdma-core), docker import.
#   2. dinomo-builder:<rust>   the base + gcc, cmake, libclang, rdma-core headers + the host's
#                              rustup toolchain (a stand-in for rust:<version>-bookworm).
#   3. cargo build --release -p dinomo-cli inside the builder, with the target dir and cargo's
#      registry bind-mounted from a cache directory, so a rebuild compiles only what changed.
#   4. docker build -f docker/Dockerfile with PREBUILT=<that binary>: the same Dockerfile users
#      with a registry build from source.
#
# Environment:
#   DINOMO_IMAGE          image to tag (default dinomo:latest)
#   DINOMO_FEATURES       cargo features of dinomo-cli (default: rdma when dinomo-cli declares
#                         it, else none; set it empty to build without the verbs backend)
#   DINOMO_DOCKER_CACHE   cache directory (default ~/.cache/dinomo-docker): target/, cargo/
#                         (registry and git checkouts), debs/ (debootstrap's downloads)
#   DEBIAN_MIRROR         default http://deb.debian.org/debian
#   DINOMO_REBUILD_BASE=1 rebuild dinomo-base and dinomo-builder even when they exist
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
repo=$(cd "$(dirname "$0")/.." && pwd)
tool=""
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --tool)
    [ -f "${2:-}" ] || { echo "build.sh: --tool needs a Cargo.toml" >&2; exit 2; }
    tool=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
    case "$tool" in "$repo"/*) ;; *) echo "build.sh: $tool is not inside $repo" >&2; exit 2 ;; esac ;;
  "") ;;
  *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
esac

image=${DINOMO_IMAGE:-dinomo:latest}
cache=${DINOMO_DOCKER_CACHE:-$HOME/.cache/dinomo-docker}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
base=dinomo-base:bookworm
runtime_pkgs="libibverbs1,librdmacm1,ibverbs-providers,rdma-core"

log() { echo "[build.sh $(date -u +%H:%M:%S)] $*"; }
die() { echo "build.sh: $*" >&2; exit 1; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "the docker daemon does not answer (docker info failed)"

# The toolchain the builder image gets: the host's active rustup toolchain.
command -v rustc >/dev/null || die "rustc is not on PATH: build.sh copies the host's rustup toolchain into its builder image"
rust_version=$(rustc --version | awk '{print $2}')
sysroot=$(rustc --print sysroot)
[ -x "$sysroot/bin/cargo" ] || die "no cargo in $sysroot/bin (build.sh needs a rustup toolchain with cargo)"
builder=dinomo-builder:$rust_version-bookworm

if [ -z "${DINOMO_FEATURES+set}" ]; then
  if grep -Eq '^[[:space:]]*rdma[[:space:]]*=' "$repo/cli/Cargo.toml"; then
    features=rdma
  else
    features=
    log "dinomo-cli has no 'rdma' feature yet: building without the verbs backend (DINOMO_FEATURES=rdma switches it on)"
  fi
else
  features=$DINOMO_FEATURES
fi

mkdir -p "$cache/target" "$cache/cargo" "$cache/debs"
work=$(mktemp -d "${TMPDIR:-/tmp}/dinomo-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)

# --- 1. base image ----------------------------------------------------------------------------
if [ "${DINOMO_REBUILD_BASE:-0}" = 1 ] || ! have_image "$base"; then
  if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || die "debootstrap is missing (apt-get install debootstrap, as root)"
    log "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  log "debootstrap --variant=minbase bookworm (+ $runtime_pkgs)"
  rootfs=$work/rootfs
  debootstrap --variant=minbase --include="$runtime_pkgs" --cache-dir="$cache/debs" \
    bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  # What a slim image drops: apt lists, docs, man pages, locales; keep dpkg from adding them back.
  cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/01-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  echo 'APT::Install-Recommends "false";' >"$rootfs/etc/apt/apt.conf.d/01-no-recommends"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log
  find "$rootfs/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  log "docker import -> $base"
  tar -C "$rootfs" --numeric-owner -c . |
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["bash"]' - "$base" >/dev/null
  rm -rf "$rootfs"
  have_image "$builder" && docker rmi "$builder" >/dev/null
fi

# --- 2. builder image ---------------------------------------------------------------------------
if [ "${DINOMO_REBUILD_BASE:-0}" = 1 ] || ! have_image "$builder"; then
  log "builder image $builder (host toolchain $sysroot)"
  ctx=$work/builder
  mkdir -p "$ctx/toolchain"
  cp "$repo/docker/builder.Dockerfile" "$ctx/Dockerfile"
  # bin/ and lib/ only: share/ is documentation (~800 MB).
  cp -a "$sysroot/bin" "$sysroot/lib" "$ctx/toolchain/"
  docker build -q --build-arg BASE_IMAGE="$base" -t "$builder" "$ctx" >/dev/null
  rm -rf "$ctx"
fi

# The builder with the cache bind-mounted, no network, as the caller.
in_builder() {
  docker run --rm --init --network none \
    --user "$(id -u):$(id -g)" \
    -v "$repo:/src:ro" -w /src \
    -v "$cache/target:/cache/target" -v "$cache/cargo:/cache/cargo" \
    -e CARGO_HOME=/cache/cargo -e CARGO_TARGET_DIR=/cache/target -e HOME=/tmp \
    -e CARGO_TERM_COLOR=never -e CARGO_TERM_PROGRESS_WHEN=never \
    -e CARGO_PROFILE_RELEASE_DEBUG=0 -e CARGO_PROFILE_RELEASE_STRIP=symbols \
    "$builder" "$@"
}

if [ -n "$tool" ]; then
  log "cargo build --release --manifest-path ${tool#"$repo"/} (cache: $cache)"
  CARGO_HOME=$cache/cargo cargo fetch --locked --manifest-path "$tool" >/dev/null
  in_builder cargo build --release --frozen --manifest-path "/src/${tool#"$repo"/}" >&2
  echo "$cache/target/release"
  exit 0
fi

# --- 3. compile, with the cache bind-mounted ----------------------------------------------------
# Crates are fetched on the host, into the cache's cargo home: the host knows its proxies and
# certificate authorities, and the container then needs no network at all (--network none).
log "cargo fetch (host, CARGO_HOME=$cache/cargo)"
CARGO_HOME=$cache/cargo cargo fetch --locked --manifest-path "$repo/Cargo.toml" >/dev/null
log "cargo build --release -p dinomo-cli ${features:+--features $features} (cache: $cache)"
# The sources read-only; Cargo.lock must not change and nothing is downloaded (--frozen).
in_builder cargo build --release --frozen -p dinomo-cli ${features:+--features "$features"}

# --- 4. the image, from the user-facing Dockerfile ------------------------------------------------
ctx=$work/image
mkdir -p "$ctx/dist"
cp "$cache/target/release/dinomo" "$ctx/dist/dinomo"
old_id=$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)
log "docker build -f docker/Dockerfile (PREBUILT) -> $image"
docker build -q -f "$repo/docker/Dockerfile" \
  --build-arg RUST_IMAGE="$base" --build-arg BASE_IMAGE="$base" \
  --build-arg PREBUILT=dist/dinomo --build-arg FEATURES="$features" \
  -t "$image" "$ctx" >/dev/null
# The legacy builder leaves the build stage as an untagged image; drop ours (labelled), no other.
docker image prune -f --filter dangling=true --filter label=org.dinomo.stage=build >/dev/null
# The image this build replaced, if nothing else uses it.
if [ -n "$old_id" ] && [ "$old_id" != "$(docker image inspect -f '{{.Id}}' "$image")" ]; then
  docker rmi "$old_id" >/dev/null 2>&1 || true
fi

log "done in $(( $(date +%s) - start )) s"
docker run --rm "$image" --version
docker images --format 'table {{.Repository}}:{{.Tag}}\t{{.Size}}' |
  grep -E "^(REPOSITORY|${image%%:*}:|dinomo-base:|dinomo-builder:)" || true
