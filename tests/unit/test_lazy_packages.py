"""Packages whose names load on first use (PEP 562 ``__getattr__``): every public name is still there, from the
module its ``if TYPE_CHECKING:`` import names, and importing a graph or a light command's module leaves the heavy
parts (the runtime's clients, the frontend's server, the router's adapter, the engines) unloaded.

Why: every ``kvmesh`` process imports a graph's configs (``components.deploy.graph``), and through eager package
``__init__``s ``kvmesh stop``/``logs``/``serve`` and the planner loaded nats-py, aiohttp, grpc and the frontend's
server on the way (~1 s of import per process on the 2-core machine, run many times by the e2e tests).
"""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LAZY = (
    "components.frontend",
    "components.router",
    "components.runtime",
    "components.workers.engines.mock",
    "components.workers.engines.vllm",
)


def type_checking_imports(package: str) -> dict[str, str]:
    """{name: absolute module} of the imports under ``if TYPE_CHECKING:`` in ``package``'s ``__init__.py``."""
    path = ROOT / Path(*package.split(".")) / "__init__.py"
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.dump(imp)
                module = f"{package}.{imp.module}" if imp.level == 1 else imp.module
                out.update({alias.name: module for alias in imp.names})
    return out


@pytest.mark.parametrize("package", LAZY)
def test_every_public_name_loads_from_the_module_its_type_checking_import_names(package):
    pkg = importlib.import_module(package)
    declared = type_checking_imports(package)
    assert sorted(declared) == sorted(pkg.__all__)
    assert pkg._WHERE == declared
    for name, module in declared.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name), name
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="no_such_name"):
        pkg.no_such_name  # noqa: B018
    # ``from pkg import submodule`` still finds the submodule (a name __getattr__ does not know is not an error there).
    assert importlib.import_module(f"{package}.config").__name__ == f"{package}.config"


# Imported together in one fresh interpreter, these must leave every HEAVY module out of sys.modules. One interpreter
# for all (~0.4 s each): what each one's import loads is part of what importing all of them loads.
LIGHT = [
    "components.deploy.graph",  # every graph file's schema: the components' configs
    "components.deploy.local",  # `kvmesh stop`, `kvmesh logs`: state files and signals
    "components.cli.serve",  # `kvmesh serve` before it starts anything, `kvmesh stop`
    "components.runtime.config",
    "components.router.policies.kv",
]
HEAVY = [
    "nats",
    "aetcd",
    "grpc",
    "aiohttp",
    "components.frontend.server",
    "components.router.adapter",
    "components.workers.engines.mock.engine",
    "components.workers.engines.vllm.engine",
]
_LOADED = """
import importlib, json, sys
for m in json.loads(sys.argv[1]):
    importlib.import_module(m)
print(json.dumps([m for m in json.loads(sys.argv[2]) if m in sys.modules]))
"""


def test_importing_the_light_modules_leaves_the_heavy_ones_unloaded():
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, json.dumps(LIGHT), json.dumps(HEAVY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
