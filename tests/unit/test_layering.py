"""The dependency direction of STYLE.md, checked on the source with ``ast`` (nothing is imported or executed).

- Only ``components/runtime`` imports the etcd client or nats-py: every other component talks to the mesh through it.
- ``components/runtime`` imports no other component, so any component can depend on it without a cycle.
- A policy module (a file under a ``policies/`` directory, or a file named ``policy.py``) imports only the standard
  library and its own package, and none of the standard library's I/O: a policy is a pure function over a snapshot
  (STYLE.md habit 1), testable without a loop, a socket or a clock.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "components"
RUNTIME = COMPONENTS / "runtime"

MESH_CLIENTS = {"nats", "aetcd", "etcd3"}
# Standard-library modules that mean I/O, concurrency or a clock of one's own; a policy takes those as inputs.
POLICY_FORBIDDEN_STDLIB = {"asyncio", "socket", "subprocess", "http", "urllib", "selectors", "multiprocessing"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in ``path``; relative imports are resolved against it."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    mod = module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):  # every import, including those inside functions and ``if TYPE_CHECKING:``
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # ``from pkg import mod`` may import a submodule: count both pkg and pkg.mod.
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def top(name: str) -> str:
    return name.split(".", 1)[0]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def policy_modules(root: Path = ROOT) -> list[Path]:
    components = root / "components"
    return [
        p for p in python_files(components) if "policies" in p.relative_to(components).parts or p.name == "policy.py"
    ]


def own_package(path: Path, root: Path = ROOT) -> str:
    """The package a policy belongs to: ``components.router`` for router/policies/x.py, its directory otherwise.

    A file under ``policies/`` may import its component's ``types``/``config`` (STYLE.md), so its own package is the
    component that holds the ``policies`` directory.
    """
    parts = path.relative_to(root).parts
    if "policies" in parts:
        return ".".join(parts[: parts.index("policies")])
    return ".".join(path.relative_to(root).parent.parts)


def policy_violations(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    package = own_package(path, root)
    return [
        (line, name)
        for line, name in imports_of(path, root)
        if name != "__future__"
        and not (name == package or name.startswith(package + "."))
        and not (top(name) in sys.stdlib_module_names and top(name) not in POLICY_FORBIDDEN_STDLIB)
    ]


def test_the_tree_is_where_the_checks_expect_it():
    # Guards the checks below against passing vacuously after a move.
    assert (RUNTIME / "bus.py").is_file() and (RUNTIME / "discovery.py").is_file()
    assert len(python_files(COMPONENTS)) > len(python_files(RUNTIME))


def test_the_import_scanner_sees_the_runtime_clients():
    # The two checks below would pass vacuously if the scanner missed these.
    found = {name for _, name in imports_of(RUNTIME / "bus.py")}
    assert {"nats", "nats.errors", "components.runtime.errors"} <= found
    assert "aetcd" in {name for _, name in imports_of(RUNTIME / "discovery.py")}


def test_only_the_runtime_imports_the_etcd_and_nats_clients():
    offenders = [
        f"{rel(path)}:{line} imports {name}"
        for path in python_files(COMPONENTS)
        if RUNTIME not in path.parents
        for line, name in imports_of(path)
        if top(name) in MESH_CLIENTS
    ]
    assert offenders == [], "only components/runtime may talk to etcd or NATS directly:\n" + "\n".join(offenders)


def test_runtime_imports_no_other_component():
    offenders = [
        f"{rel(path)}:{line} imports {name}"
        for path in python_files(RUNTIME)
        for line, name in imports_of(path)
        if name.startswith("components.")
        and not (name == "components.runtime" or name.startswith("components.runtime."))
        and not (name == "components.protocol" or name.startswith("components.protocol."))
    ]
    assert offenders == [], "components/runtime must not depend on other components:\n" + "\n".join(offenders)


def test_policy_modules_import_only_the_standard_library_and_their_own_package():
    modules = [p for p in policy_modules() if p.name != "__init__.py" or p.read_text(encoding="utf-8").strip()]
    if not any(p.name != "__init__.py" for p in modules):
        pytest.skip("no policy module yet (components/**/policies/*.py or policy.py)")
    offenders = [
        f"{rel(path)}:{line} imports {name} (allowed: the standard library without I/O, {own_package(path)}.*)"
        for path in modules
        for line, name in policy_violations(path)
    ]
    assert offenders == [], "policy modules must stay pure:\n" + "\n".join(offenders)


def test_the_policy_rule_accepts_and_rejects_what_it_should(tmp_path):
    """The policy check itself, on synthetic files: a check that cannot fail protects nothing."""
    router = tmp_path / "components" / "router" / "policies"
    planner = tmp_path / "components" / "planner"
    router.mkdir(parents=True)
    planner.mkdir(parents=True)
    (router / "good.py").write_text(
        "from __future__ import annotations\nimport math, random\nfrom dataclasses import dataclass\n"
        "from components.router.types import Snapshot\nfrom . import base\nfrom ..config import RouterConfig\n"
    )
    (router / "bad.py").write_text(
        "import asyncio\nimport numpy as np\n\ndef f():\n    from components.runtime import Runtime\n"
    )
    (planner / "policy.py").write_text("from .types import Snapshot\nfrom components.router.types import X\n")
    (planner / "loop.py").write_text("import asyncio\n")  # not a policy module: not checked

    assert sorted(rel_.name for rel_ in policy_modules(tmp_path)) == ["bad.py", "good.py", "policy.py"]
    assert own_package(router / "good.py", tmp_path) == "components.router"
    assert policy_violations(router / "good.py", tmp_path) == []
    assert policy_violations(router / "bad.py", tmp_path) == [
        (1, "asyncio"),
        (2, "numpy"),
        (5, "components.runtime"),
        (5, "components.runtime.Runtime"),
    ]
    # planner/policy.py belongs to components.planner: its own types are fine, the router's are not.
    assert policy_violations(planner / "policy.py", tmp_path) == [
        (2, "components.router.types"),
        (2, "components.router.types.X"),
    ]
