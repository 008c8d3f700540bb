"""A real Kubernetes control plane for the ``k8s`` test tier: kube-apiserver and kube-controller-manager on loopback.

The binaries come from scripts/k8s_binaries.sh (built once per machine from Debian bookworm's ``kubernetes`` source
package, cached outside the repository). ``start_kube_api`` starts, in a directory of its own:

- an etcd of its own (with tests/support/servers.py's raft timings; the API server's objects never mix with the
  keys of kvmesh's session etcd);
- kube-apiserver on 127.0.0.1 with TLS from a CA generated here (openssl CLI), a static token file whose one user is
  an admin (group ``system:masters``), RBAC as the only authorizer, and a service-account signing key;
- kube-controller-manager with the admin's kubeconfig and only the controllers the tier needs (``CONTROLLERS``), so a
  Deployment gets a ReplicaSet and Pods; no scheduler and no kubelet, so the Pods stay Pending.

Readiness is asked, never slept for: the API server's ``/readyz`` with the admin token, then the controller
manager's first visible work (the ``default`` ServiceAccount and its token Secret in namespace ``default``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.runtime.errors import ConnectError
from components.runtime.servers import EtcdServer, ServerProcess
from tests.support.servers import ELECTION_TIMEOUT_MS, HEARTBEAT_INTERVAL_MS

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, Configuration

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "scripts" / "k8s_binaries.sh"

# What the controller manager runs: Deployments -> ReplicaSets -> Pods; the ServiceAccount admission plugin (on by
# default) refuses a Pod until its namespace's `default` ServiceAccount and that account's token Secret exist, so
# the two controllers that make them; `namespace` finishes a deleted namespace (every test deletes its own);
# `garbagecollector` deletes a deleted Deployment's ReplicaSets and Pods, as a cluster does.
CONTROLLERS = ("deployment", "replicaset", "serviceaccount", "serviceaccount-token", "namespace", "garbagecollector")

ADMIN_USER = "kvmesh-admin"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class K8sBinariesUnavailable(RuntimeError):
    """scripts/k8s_binaries.sh failed; the message carries its last lines (the failed step is named there)."""


def binaries_dir(build: bool = True, log_path: Path | None = None) -> Path:
    """The directory with kube-apiserver and kube-controller-manager: built first if missing and ``build``.

    The build (minutes, the first time on a machine) writes its output to ``log_path`` (a temporary file if None);
    concurrent callers wait on the script's lock instead of building twice."""
    if override := os.environ.get("KVMESH_K8S_BIN_DIR"):
        return Path(override)
    args = ["bash", str(BUILD_SCRIPT)] + ([] if build else ["--check"])
    if log_path is None:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvmesh-k8s-build-{os.getpid()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.run(args, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        what = "built" if build else "present"
        cmd = " ".join(args)
        raise K8sBinariesUnavailable(f"the Kubernetes binaries are not {what} ({cmd}; log {log_path}):\n{tail}")
    log_path.unlink(missing_ok=True)
    return Path(proc.stdout.decode().strip().splitlines()[-1])


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}")


def make_certificates(pki: Path) -> None:
    """A CA, the API server's serving certificate for 127.0.0.1/localhost signed by it, and the service-account
    signing key pair: ca.crt, server.crt/server.key, sa.key/sa.pub in ``pki``. EC P-256 keys: generated in
    milliseconds where RSA-2048 takes a noticeable fraction of a second each."""
    pki.mkdir(parents=True, exist_ok=True)
    (pki / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "30", "-subj", "/CN=kvmesh-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=pki)  # fmt: skip
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=kube-apiserver", cwd=pki)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "30", "-extfile", "server.ext", cwd=pki)  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=pki)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, url: str, ca_path: Path, token: str, user: str = ADMIN_USER) -> Path:
    """A kubeconfig with one cluster, one token user and a current context (JSON is YAML, so any loader reads it)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kvmesh-test", "cluster": {"server": url, "certificate-authority": str(ca_path)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "kvmesh-test", "context": {"cluster": "kvmesh-test", "user": user}}],
        "current-context": "kvmesh-test",
    }
    path.write_text(json.dumps(config, indent=2))
    return path


def _die_with_parent() -> list[str]:
    """A command prefix that makes the process get SIGTERM when the test process dies, however it ends (even
    SIGKILL), so no 110 MB API server outlives a killed pytest: util-linux's setpriv sets the parent-death signal,
    which survives its exec. Empty where setpriv is missing (the fixture's teardown still stops them)."""
    return ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []


class _Etcd(EtcdServer):
    """tests/support/servers.py's test etcd (its shortened raft timings), also ended with the test process."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS, election_timeout_ms=ELECTION_TIMEOUT_MS)

    def command(self) -> list[str]:
        return [*_die_with_parent(), *super().command()]


class KubeApiServer(ServerProcess):
    """kube-apiserver on ``host``:``port`` (HTTPS only: ``--insecure-port=0``, or 1.20 would also bind 8080)."""

    name = "kube-apiserver"

    def __init__(self, binary: Path, data_dir: Path, etcd_endpoint: str, token: str) -> None:
        super().__init__(data_dir, "127.0.0.1", None)
        self.binary = binary
        self.etcd_endpoint = etcd_endpoint
        self.token = token
        self.pki = data_dir / "pki"

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def command(self) -> list[str]:
        pki = self.pki
        return [
            *_die_with_parent(),
            str(self.binary),
            f"--etcd-servers={self.etcd_endpoint}",
            f"--bind-address={self.host}",
            f"--advertise-address={self.host}",
            f"--secure-port={self.port}",
            "--insecure-port=0",
            f"--cert-dir={self.data_dir / 'certs'}",
            f"--tls-cert-file={pki / 'server.crt'}",
            f"--tls-private-key-file={pki / 'server.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={self.data_dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--profiling=false",
        ]

    def _wait_ready(self, timeout_s: float) -> None:
        # /readyz turns 200 once every post-start hook ran (RBAC's bootstrap roles among them); asked with the admin
        # token, as the anonymous user may not read it.
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        req = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {self.token}"})
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[-300:]}"
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise ConnectError(self.name, self.url, f"/readyz not ok within {timeout_s} s ({last}); see {self.log_path}")


@dataclass
class KubeApi:
    """What the ``kube_api`` fixture yields: a running API server and controller manager.

    ``url``: https://127.0.0.1:PORT. ``token``: the admin's bearer token (group system:masters). ``ca_path``: the CA
    that signed the serving certificate. ``kubeconfig_path``: a kubeconfig with the three, for
    ``kubernetes_asyncio.config.load_kube_config(config_file=...)`` or ``kvmesh ... --kubeconfig``. ``log_dir``:
    where kube-apiserver.log and kube-controller-manager.log are."""

    url: str
    token: str
    ca_path: Path
    kubeconfig_path: Path
    log_dir: Path
    etcd_endpoint: str
    _stack: contextlib.ExitStack = field(repr=False, default_factory=contextlib.ExitStack)

    def configuration(self) -> Configuration:
        """A kubernetes-asyncio Configuration: this server, its CA, the admin token."""
        from kubernetes_asyncio.client import Configuration

        cfg = Configuration(host=self.url, api_key={"BearerToken": f"Bearer {self.token}"})
        cfg.ssl_ca_cert = str(self.ca_path)
        return cfg

    def client(self, as_user: str | None = None) -> ApiClient:
        """A kubernetes-asyncio ApiClient (use it as ``async with kube_api.client() as api:``, or close it).

        ``as_user``: every request impersonates this user (``Impersonate-User``): the API server authorizes it with
        RBAC as that user, who also gets the group system:authenticated. For a ServiceAccount pass
        ``KubeApi.service_account_user(namespace, name)``; RoleBindings whose subject is that ServiceAccount then
        apply (its group system:serviceaccounts is not impersonated)."""
        from kubernetes_asyncio.client import ApiClient

        api = ApiClient(self.configuration())
        if as_user is not None:
            api.set_default_header("Impersonate-User", as_user)
        return api

    @staticmethod
    def service_account_user(namespace: str, name: str) -> str:
        """The user name the API server gives a ServiceAccount's tokens."""
        return f"system:serviceaccount:{namespace}:{name}"

    def log_tails(self, chars: int = 4000) -> dict[str, str]:
        """The end of each component's log, for a failed test's report."""
        out = {}
        for name in ("kube-apiserver", "kube-controller-manager"):
            path = self.log_dir / f"{name}.log"
            with contextlib.suppress(OSError):
                out[name] = path.read_text(errors="replace")[-chars:]
        return out

    def stop(self) -> None:
        self._stack.close()


class _ControllerManager:
    """kube-controller-manager: no port of its own (``--port=0 --secure-port=0``), so several test processes never
    contend for 10252/10257; it is ready when its controllers' first objects appear (``start_kube_api``)."""

    def __init__(self, binary: Path, data_dir: Path, kubeconfig: Path, pki: Path) -> None:
        self.log_path = data_dir / "kube-controller-manager.log"
        self.cmd = [
            *_die_with_parent(),
            str(binary),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--port=0",
            "--secure-port=0",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--profiling=false",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0
            )

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _get_json(url: str, token: str, ca: Path) -> Any:
    ctx = ssl.create_default_context(cafile=str(ca))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
        return json.loads(r.read())


def _wait_controller_manager(api: KubeApi, cm: _ControllerManager, timeout_s: float) -> None:
    """Until the controller manager has made namespace default's ServiceAccount and its token Secret: it then runs,
    reaches the API server as admin, and Pods can be admitted."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if cm.proc is not None and cm.proc.poll() is not None:
            why = f"exited with {cm.proc.returncode}; see {cm.log_path}"
            raise ConnectError("kube-controller-manager", api.url, why)
        try:
            sa = _get_json(f"{api.url}/api/v1/namespaces/default/serviceaccounts/default", api.token, api.ca_path)
            if sa.get("secrets"):
                return
            last = "the default ServiceAccount has no token Secret yet"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    why = f"no default ServiceAccount token within {timeout_s} s ({last}); see {cm.log_path}"
    raise ConnectError("kube-controller-manager", api.url, why)


def start_kube_api(work_dir: Path, bin_dir: Path, timeout_s: float = 90.0) -> KubeApi:
    """Start etcd, kube-apiserver and kube-controller-manager under ``work_dir``; the caller stops them with
    ``KubeApi.stop()`` (also when this raises midway: it cleans up what it started, then raises)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    try:
        etcd = _Etcd(work_dir / "etcd")
        stack.callback(etcd.stop)
        etcd.start()

        token = secrets.token_hex(16)
        apiserver = KubeApiServer(bin_dir / "kube-apiserver", work_dir, etcd.endpoint, token)
        make_certificates(apiserver.pki)
        (work_dir / "tokens.csv").write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        stack.callback(apiserver.stop)
        apiserver.start(timeout_s=timeout_s)

        ca = apiserver.pki / "ca.crt"
        kubeconfig = write_kubeconfig(work_dir / "kubeconfig", apiserver.url, ca, token)
        api = KubeApi(
            url=apiserver.url,
            token=token,
            ca_path=ca,
            kubeconfig_path=kubeconfig,
            log_dir=work_dir,
            etcd_endpoint=etcd.endpoint,
            _stack=stack,
        )
        cm = _ControllerManager(bin_dir / "kube-controller-manager", work_dir, kubeconfig, apiserver.pki)
        stack.callback(cm.stop)
        cm.start()
        _wait_controller_manager(api, cm, timeout_s)
        return api
    except BaseException:
        stack.close()
        raise
