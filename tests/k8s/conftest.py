"""Fixtures of the ``k8s`` tier: a real kube-apiserver and kube-controller-manager (tests/support/k8s.py).

- ``kube_api`` (session): the running control plane, a ``tests.support.k8s.KubeApi``. Under pytest-xdist every test
  marked ``k8s`` goes to one worker (tests/conftest.py's grouping), so one run starts one API server.
- ``kube_namespace``: a namespace of the test's own, created before it and deleted after it.
- ``kube_client``: an admin kubernetes-asyncio ApiClient, closed after the test.

The binaries are built (scripts/k8s_binaries.sh; minutes, once per machine) right after collection when a selected
test is marked ``k8s``: outside any test, so pytest-timeout's per-test limit does not cover the build. If they cannot
be built, the tier's tests skip with the build's message, except under CI=true, where they fail.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from components.runtime.errors import ConnectError
from tests.support.k8s import K8sBinariesUnavailable, KubeApi, binaries_dir, start_kube_api

_binaries: Path | K8sBinariesUnavailable | None = None
_running: list[KubeApi] = []
_namespaces = itertools.count(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    global _binaries
    if _binaries is not None or not any(item.get_closest_marker("k8s") for item in session.items):
        return
    try:
        _binaries = binaries_dir(build=False)
        return
    except K8sBinariesUnavailable:
        pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("k8s tier: building kube-apiserver and kube-controller-manager (scripts/k8s_binaries.sh)")
    try:
        _binaries = binaries_dir(build=True)
    except K8sBinariesUnavailable as e:
        _binaries = e


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeApi]:
    binaries = _binaries
    if binaries is None:  # a test reached without collection_finish seeing it (e.g. a plugin reordering): build now
        try:
            binaries = binaries_dir(build=True)
        except K8sBinariesUnavailable as e:
            binaries = e
    if isinstance(binaries, K8sBinariesUnavailable):
        if os.environ.get("CI") == "true":
            pytest.fail(str(binaries))
        pytest.skip(str(binaries))
    work = tmp_path_factory.mktemp("kube-api")
    try:
        api = start_kube_api(work, binaries)
    except (ConnectError, RuntimeError, OSError) as e:  # a process failed to start or answer, or openssl did
        tails = "\n".join(
            f"--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("*.log"))
        )
        pytest.fail(f"the Kubernetes control plane did not start: {e}\n{tails}")
    _running.append(api)
    try:
        yield api
    finally:
        _running.remove(api)
        api.stop()


@pytest.fixture
async def kube_client(kube_api: KubeApi) -> AsyncIterator[object]:
    async with kube_api.client() as api:
        yield api


@pytest.fixture
async def kube_namespace(kube_api: KubeApi) -> AsyncIterator[str]:
    from kubernetes_asyncio import client

    name = f"kt{next(_namespaces)}"
    async with kube_api.client() as api:
        await client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        yield name
        # Not waited for: the namespace controller finishes it (and its objects) behind the next tests.
        await client.CoreV1Api(api).delete_namespace(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.failed and _running and item.get_closest_marker("k8s") is not None:
        for name, tail in _running[0].log_tails().items():
            report.sections.append((f"{name} log (tail)", tail))
    return report
