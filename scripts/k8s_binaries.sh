#!/usr/bin/env bash
# Builds kube-apiserver and kube-controller-manager for the `k8s` test tier (tests/k8s) from Debian bookworm's
# `kubernetes` source package with Debian's golang-go, once per machine, and prints the directory that holds them.
#
#   bash scripts/k8s_binaries.sh          build if missing, then print the binaries' directory on stdout
#   bash scripts/k8s_binaries.sh --check  print the directory if both binaries are there, else exit 1 (builds nothing)
#
# Cache: ${KVMESH_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/k8s}/<package version>/ (outside the repository:
# the two binaries are ~110 MB each and never committed). A second run only checks that they exist. A lock file
# (flock) in the cache makes concurrent callers (two pytest-xdist workers, dev.sh setup beside a test run) wait for
# the one build instead of starting their own.
#
# Needs apt-get (root, or sudo) on Debian bookworm or a derivative with a deb822 source for bookworm main in
# /etc/apt/sources.list.d/debian.sources: a deb-src entry derived from it goes into a separate file,
# /etc/apt/sources.list.d/kvmesh-k8s-deb-src.sources (the original is left as it is). Each step that fails names
# itself on stderr ("k8s build failed at step ...") and exits non-zero.
#
# Why bash and not Python: every step is apt-get, flock, make; the pytest fixture (tests/support/k8s.py) and
# scripts/dev.sh setup both run this same file, so a fresh CI machine and a laptop build the same way.
set -euo pipefail

# The package's version is the cache key: a different version builds into a different directory.
K8S_DEB_VERSION="${KVMESH_K8S_DEB_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}"
CACHE_ROOT="${KVMESH_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/k8s}"
DIR="$CACHE_ROOT/$K8S_DEB_VERSION"
BIN="$DIR/bin"
SRC_LIST=/etc/apt/sources.list.d/kvmesh-k8s-deb-src.sources
BINARIES=(kube-apiserver kube-controller-manager)

log() { printf '[k8s binaries] %s\n' "$*" >&2; }
fail() { log "k8s build failed at step '$1': $2"; exit 1; }

have_binaries() {
  local b
  for b in "${BINARIES[@]}"; do
    [ -x "$BIN/$b" ] || return 1
  done
}

if [ "${1:-}" = --check ]; then
  have_binaries && { echo "$BIN"; exit 0; }
  exit 1
fi
if have_binaries; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$DIR" || fail "cache directory" "cannot create $DIR"
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
  log "another process is building the binaries (lock $CACHE_ROOT/.build.lock): waiting for it"
  flock 9
fi
# The build we waited for may have produced them.
if have_binaries; then
  echo "$BIN"
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || fail "privileges" "not root and sudo is unavailable: apt-get needs one of them"
  SUDO="sudo"
fi
command -v apt-get >/dev/null || fail "apt" "apt-get not found: the tier builds from Debian's kubernetes source package"

# The source's stanza for bookworm main, as deb-src: same URIs and Signed-By as the machine's own deb entry (a
# snapshot mirror or a local proxy keeps working), suite bookworm only (the package is in bookworm's main).
derive_deb_src() {
  local origin=/etc/apt/sources.list.d/debian.sources
  [ -f "$origin" ] || fail "deb-src entry" "$origin not found: add a deb-src line for bookworm main yourself"
  awk '
    function flush() {
      if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ / bookworm / && (" " comps " ") ~ / main / && uris != "") {
        print "Types: deb-src"; print "URIs: " uris; print "Suites: bookworm"; print "Components: main"
        if (signed != "") print "Signed-By: " signed
        found = 1; exit
      }
      types = ""; uris = ""; suites = ""; comps = ""; signed = ""
    }
    /^[ \t]*$/ { flush(); next }
    /^#/ { next }
    /^Types:/ { sub(/^Types:[ \t]*/, ""); types = $0 }
    /^URIs:/ { sub(/^URIs:[ \t]*/, ""); uris = $0 }
    /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
    /^Components:/ { sub(/^Components:[ \t]*/, ""); comps = $0 }
    /^Signed-By:/ { sub(/^Signed-By:[ \t]*/, ""); signed = $0 }
    END { if (!found) flush(); if (!found) exit 1 }
  ' "$origin"
}

source_known() {
  apt-cache showsrc kubernetes 2>/dev/null | grep -qx "Version: $K8S_DEB_VERSION"
}

if ! source_known; then
  if [ ! -f "$SRC_LIST" ]; then
    entry="$(derive_deb_src)" || fail "deb-src entry" "no deb stanza for bookworm main in /etc/apt/sources.list.d/debian.sources"
    log "adding $SRC_LIST (deb-src for bookworm main, from debian.sources)"
    printf '%s\n' "$entry" | $SUDO tee "$SRC_LIST" >/dev/null || fail "deb-src entry" "cannot write $SRC_LIST"
  fi
  log "apt-get update"
  $SUDO apt-get update -qq >&2 || fail "apt-get update" "see apt's message above"
  source_known || fail "apt-get source" "kubernetes $K8S_DEB_VERSION is not in the apt sources (apt-cache showsrc kubernetes lists what is; KVMESH_K8S_DEB_VERSION picks another)"
fi

# golang-go: bookworm's Go 1.19; dpkg-dev unpacks the source package (dpkg-source); make and rsync for the build.
missing=()
for pkg in golang-go dpkg-dev make rsync; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2 \
    || fail "apt-get install" "could not install ${missing[*]}"
fi

SRC="$DIR/src"
TREE="$SRC/kubernetes-${K8S_DEB_VERSION%-*}"
if [ ! -f "$TREE/.kvmesh-unpacked" ]; then
  rm -rf "$SRC"
  mkdir -p "$SRC"
  log "apt-get source kubernetes=$K8S_DEB_VERSION into $SRC"
  (cd "$SRC" && apt-get source -qq "kubernetes=$K8S_DEB_VERSION" >&2) || fail "apt-get source" "see apt's message above"
  [ -d "$TREE" ] || fail "apt-get source" "expected the unpacked tree at $TREE"
  touch "$TREE/.kvmesh-unpacked"
fi

# GOPATH mode, as Kubernetes 1.20's own build expects: the tree must sit at $GOPATH/src/k8s.io/kubernetes, so a
# symlink there points back at it. No network: GOPROXY=off with the package's vendor/ directory.
mkdir -p "$TREE/.go/src/k8s.io"
ln -sfn "$TREE" "$TREE/.go/src/k8s.io/kubernetes"
started=$SECONDS
for b in "${BINARIES[@]}"; do
  log "make WHAT=cmd/$b (several minutes on a cold cache)"
  (
    cd "$TREE/.go/src/k8s.io/kubernetes" &&
      env GOPATH="$TREE/.go" GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS=-mod=vendor \
        GOCACHE="$DIR/gocache" make WHAT="cmd/$b" >&2
  ) || fail "make WHAT=cmd/$b" "see the compiler's output above"
  built="$(find "$TREE/_output" -type f -name "$b" -perm -u+x 2>/dev/null | head -1)"
  [ -n "$built" ] || fail "make WHAT=cmd/$b" "no $b under $TREE/_output after the build"
  mkdir -p "$BIN"
  cp "$built" "$BIN/$b.tmp" && mv "$BIN/$b.tmp" "$BIN/$b" || fail "install $b" "cannot copy it to $BIN"
  log "$b built ($((SECONDS - started)) s since the first make)"
done
# The unpacked tree, its _output and Go's build cache take ~2.2 GB besides the two binaries (~215 MB); only the
# binaries are used from here on (a new package version builds into a new directory from scratch anyway).
rm -rf "$SRC" "$DIR/gocache"
echo "$BIN"
