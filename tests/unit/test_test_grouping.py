"""The suite's layout over pytest-xdist workers (tests/conftest.py: ``xdist_group`` marks, ``--dist loadgroup``)
works with the installed pytest and pytest-xdist: a module's tests all run in one worker process. With pytest 9.2
and pytest-xdist 3.8 the marks were ignored (pytest-xdist issue 1386) and modules spread over both workers, starting
their shared servers twice; pyproject.toml pins pytest below 9.2 for that."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CONFTEST = """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
"""

MODULE = """
import os
import pytest

@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.environ["GROUPING_OUT"], "a") as f:
        f.write(f"{__name__} {os.environ.get('PYTEST_XDIST_WORKER', '-')}\\n")
"""


def test_a_modules_tests_run_in_one_xdist_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        (tmp_path / name).write_text(MODULE)
    out = tmp_path / "where.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"GROUPING_OUT": str(out), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for line in out.read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == {"test_a", "test_b", "test_c"}
    assert all(len(w) == 1 and "-" not in w for w in workers.values()), workers
