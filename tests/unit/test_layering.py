"""The dependency direction of STYLE.md, checked on the source with ``ast`` (nothing is imported or executed), and
the purity of policies checked by importing them in a fresh interpreter.

- Only ``components/runtime`` imports the etcd client or nats-py: every other component talks to the mesh through it.
- ``components/protocol`` (the wire contract) imports nothing of kvmesh; ``components/runtime`` imports only it.
- Packages have ranks (``RANKS``, lowest first); a package imports only packages of lower rank, never one of its own
  rank or above, so the drawing of imports has no arrow running back up and no circle (also checked directly).
- Nothing outside ``components/cli`` imports it; nothing outside ``components/workers`` imports its engines.
- A *pure config module* (``components/<package>/config.py`` that imports only the standard library and pydantic) is
  a leaf: any package may import it, whatever the ranks, and such an import is no edge of the package graph. A
  component's config is data (its fields, defaults and validation), not behaviour; a graph file's sections are the
  component configs (components/deploy/graph.py), including the planner's, whose package sits above ``deploy``
  because its circus connector drives deployments. A config module that imports anything else (the runtime, a
  client) gets no such pass.
- A policy module (a file under a ``policies/`` directory, or a file named ``policy.py``) imports only the standard
  library and its own package, and none of the standard library's I/O: a policy is a pure function over a snapshot
  (STYLE.md habit 1), testable without a loop, a socket or a clock. And importing it in a fresh interpreter leaves
  every mesh, HTTP, circus and Kubernetes client out of ``sys.modules``: pure as an import, not only as a file.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "components"
RUNTIME = COMPONENTS / "runtime"

MESH_CLIENTS = {"nats", "aetcd", "etcd3"}
# What importing a policy must never load (a policy that reaches the runtime or the HTTP stack through its package's
# __init__ is pure as a file and not as an import).
IO_CLIENTS = ("nats", "aetcd", "aiohttp", "circus", "kubernetes", "kubernetes_asyncio")

# Lowest first. A package may import packages of lower rank only. protocol: the wire contract; perf: the engine
# performance model (standard library only); runtime: etcd/NATS; fleet: one view of the fleet; router and migration
# (its per-worker agent is used by workers) sit below workers and frontend; sim runs the real policies on a virtual
# clock; deploy (graphs, watcher plans, circus, state) is used by the planner's connectors and by the command line,
# which imports everyone. rescheduler (5) runs fleet views (3) through the migration agent (4) with perf's (1)
# predictions, and sim (6) must run the same cycle, so it sits between them; at the frontend's rank so that the
# frontend cannot import it: the command line wires a colocated rescheduler into the frontend process. A package
# named here that does not exist in a tree is harmless.
RANKS = {
    "protocol": 0,
    "perf": 1,
    "runtime": 2,
    "fleet": 3,
    "router": 4,
    "migration": 4,
    "workers": 5,
    "frontend": 5,
    "rescheduler": 5,
    "sim": 6,
    "deploy": 7,
    "planner": 8,
    "cli": 9,
}
# What a pure config module may import besides the standard library.
CONFIG_THIRD_PARTY = {"pydantic", "pydantic_core"}
# Standard-library modules that mean I/O, concurrency or a clock of one's own; a policy takes those as inputs.
POLICY_FORBIDDEN_STDLIB = {"asyncio", "socket", "subprocess", "http", "urllib", "selectors", "multiprocessing"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in ``path``; relative imports are resolved against it."""
    st = path.stat()
    return list(_imports_of(path, root, st.st_mtime_ns, st.st_size))


# The package checks below each read every file of components/ (~1 s of parsing per check on the 2-core machine); a
# file is parsed once per content, keyed by its modification time and size.
@functools.cache
def _imports_of(path: Path, root: Path, mtime_ns: int, size: int) -> tuple[tuple[int, str], ...]:
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
    return tuple(found)


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


# ---------------------------------------------------------------------------------------------------------------------
# Packages: ranks, cycles, private parts


def package_of(name: str) -> str | None:
    """``components.router.policies.kv`` -> ``router``; None for what is not a kvmesh package."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "components" else None


def pure_config_modules(root: Path = ROOT) -> set[str]:
    """``components.<package>.config`` modules that import only the standard library and pydantic (module docstring)."""
    out = set()
    for path in sorted((root / "components").glob("*/config.py")):
        names = [name for _, name in imports_of(path, root) if name != "__future__"]
        if all(top(n) in sys.stdlib_module_names or top(n) in CONFIG_THIRD_PARTY for n in names):
            out.add(module_name(path, root))
    return out


def package_imports(root: Path = ROOT) -> list[tuple[Path, int, str, str, str]]:
    """(file, line, importing package, imported package, imported module) for every import between kvmesh packages,
    less imports of pure config modules (leaves: module docstring)."""
    out = []
    components = root / "components"
    leaves = pure_config_modules(root)
    for path in python_files(components):
        rel_parts = path.relative_to(components).parts
        if len(rel_parts) < 2:
            continue  # components/__init__.py
        mine = rel_parts[0]
        for line, name in imports_of(path, root):
            theirs = package_of(name)
            if any(name == leaf or name.startswith(leaf + ".") for leaf in leaves):
                continue
            if theirs is not None and theirs != mine:
                out.append((path, line, mine, theirs, name))
    return out


def rank_violations(root: Path = ROOT) -> list[str]:
    out = []
    for path, line, mine, theirs, name in package_imports(root):
        if mine not in RANKS or theirs not in RANKS:
            out.append(f"{path.relative_to(root)}:{line}: package {mine!r} or {theirs!r} has no rank in RANKS")
        elif RANKS[theirs] >= RANKS[mine]:
            out.append(
                f"{path.relative_to(root)}:{line} imports {name}: {mine} (rank {RANKS[mine]}) may import only "
                f"packages of lower rank, {theirs} has rank {RANKS[theirs]}"
            )
    return out


def cycles(root: Path = ROOT) -> list[list[str]]:
    """Every elementary cycle's first appearance in the package import graph (depth-first search)."""
    graph: dict[str, set[str]] = {}
    for _, _, mine, theirs, _ in package_imports(root):
        graph.setdefault(mine, set()).add(theirs)
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = [*path[path.index(nxt) :], nxt]
                if sorted(cycle[:-1]) not in [sorted(c[:-1]) for c in found]:
                    found.append(cycle)
            else:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def private_violations(root: Path = ROOT) -> list[str]:
    """Nothing outside cli imports cli; nothing outside workers imports workers.engines; protocol imports no kvmesh."""
    out = []
    for path, line, mine, theirs, name in package_imports(root):
        where = f"{path.relative_to(root)}:{line} imports {name}"
        if theirs == "cli":
            out.append(f"{where}: only the command line imports components.cli")
        if name.startswith("components.workers.engines") and mine != "workers":
            out.append(f"{where}: only components.workers imports its engines")
        if mine == "protocol":
            out.append(f"{where}: components.protocol imports nothing of kvmesh")
    return out


def test_packages_import_only_packages_of_lower_rank():
    assert rank_violations() == []


def test_the_package_import_graph_has_no_cycle():
    assert cycles() == []


def test_cli_and_the_engines_are_private_and_the_protocol_imports_nothing():
    assert private_violations() == []


def test_every_package_has_a_rank():
    packages = {p.name for p in COMPONENTS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages <= set(RANKS), f"give these a rank in RANKS: {sorted(packages - set(RANKS))}"


def test_the_package_rules_reject_what_they_should(tmp_path):
    """The package checks themselves, on a synthetic tree that breaks each rule once."""

    def write(rel: str, text: str) -> None:
        f = tmp_path / "components" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    for pkg in ("protocol", "runtime", "router", "workers", "frontend", "cli"):
        write(f"{pkg}/__init__.py", "")
    write("protocol/messages.py", "from components.runtime import errors\n")  # up, and protocol imports kvmesh
    write("runtime/bus.py", "from components.protocol import messages\n")  # down: fine
    write("router/adapter.py", "from components.frontend import app\n")  # up: frontend has a higher rank
    write("frontend/app.py", "from components.router import adapter\nfrom components.workers.engines import mock\n")
    write("workers/main.py", "from components.cli import args\nfrom components.workers.engines import mock\n")
    write("cli/main.py", "from components.frontend import app\n")

    ranks = sorted({v.split(" ")[0] for v in rank_violations(tmp_path)})
    assert ranks == [
        "components/frontend/app.py:2",  # workers has the frontend's own rank
        "components/protocol/messages.py:1",
        "components/router/adapter.py:1",
        "components/workers/main.py:1",
    ]
    assert ["frontend", "router", "frontend"] in cycles(tmp_path) or ["router", "frontend", "router"] in cycles(
        tmp_path
    )
    private = private_violations(tmp_path)
    assert any("frontend/app.py:2" in v and "engines" in v for v in private)
    assert any("workers/main.py:1" in v and "components.cli" in v for v in private)
    assert any("protocol/messages.py:1" in v and "imports nothing" in v for v in private)
    assert not any("workers/main.py:2" in v for v in private)  # workers may import its own engines


def test_a_pure_config_module_is_a_leaf_and_an_impure_one_is_not(tmp_path):
    """The config-leaf rule on a synthetic tree: deploy may import the planner's pydantic-only config although the
    planner ranks above it; a config that imports the runtime is an ordinary module and the same import is refused."""

    def write(rel: str, text: str) -> None:
        f = tmp_path / "components" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    for pkg in ("runtime", "deploy", "planner", "cli"):
        write(f"{pkg}/__init__.py", "")
    write("planner/config.py", "from __future__ import annotations\nimport enum\nfrom pydantic import BaseModel\n")
    write("planner/connectors.py", "from components.deploy import graph\n")  # down: fine
    write("deploy/graph.py", "from components.planner.config import PlannerConfig\nfrom components.cli import config\n")
    write("cli/config.py", "from components.runtime import flags\nfrom pydantic import BaseModel\n")

    assert pure_config_modules(tmp_path) == {"components.planner.config"}
    assert {v.split(" ")[0] for v in rank_violations(tmp_path)} == {"components/deploy/graph.py:2"}
    assert cycles(tmp_path) == []
    assert "components.planner.config" in pure_config_modules()  # the real one qualifies


# ---------------------------------------------------------------------------------------------------------------------
# Policies, as imports


def import_leaves(module: str, root: Path = ROOT) -> list[str]:
    """Which of IO_CLIENTS importing ``module`` in a fresh interpreter loads."""
    return import_leaves_together([module], root)


def import_leaves_together(modules: list[str], root: Path = ROOT) -> list[str]:
    """Which of IO_CLIENTS importing every one of ``modules`` in one fresh interpreter loads."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(json.dumps([m for m in {IO_CLIENTS!r} if m in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def impure_imports(modules: list[str], root: Path = ROOT) -> dict[str, list[str]]:
    """{module: the IO clients importing it alone in a fresh interpreter loads}, for the modules that load any.

    One interpreter imports them all first: what one module's import loads is part of what importing all of them
    loads (an import runs the same code whatever was imported before, none of ours looks at ``sys.modules``; it
    only skips modules already loaded), so when all of them together load no client, none of them alone does, and
    the check costs one interpreter instead of one per policy (13 today, ~0.2 s each). Only when a client shows up
    does each module get its own interpreter, to name the culprits exactly."""
    if not modules or not import_leaves_together(modules, root):
        return {}
    return {m: loaded for m in modules if (loaded := import_leaves(m, root))}


def test_importing_a_policy_module_loads_no_mesh_http_circus_or_kubernetes_client():
    modules = [module_name(p) for p in policy_modules()]
    assert any(m.startswith("components.router.policies.") for m in modules)  # the check is not vacuous
    offenders = impure_imports(modules)
    assert offenders == {}, "policy modules must import without I/O clients:\n" + "\n".join(
        f"{m} loads {loaded}" for m, loaded in offenders.items()
    )


def test_the_fresh_interpreter_check_sees_a_client_loaded_through_a_package(tmp_path):
    # A package whose __init__ pulls in aiohttp makes its pure-looking submodule impure as an import.
    pkg = tmp_path / "impure_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import aiohttp\n")
    (pkg / "policy.py").write_text("import math\n")
    assert import_leaves("impure_pkg.policy", tmp_path) == ["aiohttp"]


def test_the_batched_check_names_each_module_that_loads_a_client_and_no_other(tmp_path):
    # Two pure modules, one that loads a client itself, one that loads it through its package: imported together they
    # load it, and the per-module pass names exactly the two impure ones. The client is a stand-in ``circus`` package
    # in tmp_path (first on the fresh interpreter's path): the check looks at names, and a stand-in imports at once.
    for pkg, init in (("circus", ""), ("pure_pkg", ""), ("impure_pkg", "import circus\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(init)
    (tmp_path / "pure_pkg" / "a.py").write_text("import math\n")
    (tmp_path / "pure_pkg" / "b.py").write_text("import json\n")
    (tmp_path / "pure_pkg" / "c.py").write_text("import circus\n")
    (tmp_path / "impure_pkg" / "policy.py").write_text("import math\n")
    modules = ["pure_pkg.a", "pure_pkg.c", "pure_pkg.b", "impure_pkg.policy"]
    assert impure_imports(modules, tmp_path) == {"pure_pkg.c": ["circus"], "impure_pkg.policy": ["circus"]}
    assert impure_imports(["pure_pkg.a", "pure_pkg.b"], tmp_path) == {}
