"""The SLA planner's core stays pure (STYLE.md habit 1; issue 25's brief: standard library plus ``components.perf``):
every module of components/planner/sla imports only the standard library without I/O, clock-of-its-own or concurrency
modules, ``components.perf`` and its own package. Read with ``ast``, so nothing is imported to check it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SLA = Path(__file__).resolve().parents[4] / "components" / "planner" / "sla"
FORBIDDEN = {"asyncio", "socket", "subprocess", "http", "urllib", "selectors", "multiprocessing", "time", "threading"}
ALLOWED_PREFIXES = ("components.perf", "components.planner.sla")
# Two modules of the package are not the core and may import more: its config (pydantic, as every component's
# config), and its controller, which reads the fleet view's types and emits the load planner's decision types (still
# no I/O: ``test_the_controller_and_config_import_no_io``).
NOT_CORE = {
    "config.py": ("pydantic",),
    "controller.py": (
        "components.fleet.model",
        "components.planner.config",
        "components.planner.controller",
        "components.planner.policy",
    ),
}


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("components.planner.sla" if node.level else (node.module or ""))
    return out


def test_the_sla_core_imports_only_the_standard_library_and_the_perf_package():
    files = sorted(SLA.glob("*.py"))
    assert {p.name for p in files} >= {"predictors.py", "replicas.py", "consolidation.py", "budget.py", "startup.py"}
    offenders = []
    for path in files:
        if path.name in NOT_CORE:
            continue
        for name in imports(path):
            top = name.split(".", 1)[0]
            if name == "__future__" or name.startswith(ALLOWED_PREFIXES):
                continue
            if top in sys.stdlib_module_names and top not in FORBIDDEN:
                continue
            offenders.append(f"{path.name} imports {name}")
    assert offenders == []


def test_the_controller_and_config_import_no_io():
    offenders = []
    for file, extra in NOT_CORE.items():
        for name in imports(SLA / file):
            top = name.split(".", 1)[0]
            if name == "__future__" or name.startswith(ALLOWED_PREFIXES + extra):
                continue
            if top in sys.stdlib_module_names and top not in FORBIDDEN:
                continue
            offenders.append(f"{file} imports {name}")
    assert offenders == []
