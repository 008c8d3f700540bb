"""etcd and NATS credentials, from the environment only (never flags: a process's argv is readable by anyone on the
machine). On Kubernetes they come from a Secret (components/deploy/k8s.py renders the references).

- ``KVMESH_ETCD_USERNAME`` / ``KVMESH_ETCD_PASSWORD``: etcd's user authentication (both or neither);
- ``KVMESH_NATS_USER`` / ``KVMESH_NATS_PASSWORD`` (both or neither), or ``KVMESH_NATS_TOKEN``: nats-server's
  authorization. A user and password inside ``KVMESH_NATS_URL`` work too (nats-py reads them from the URL).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from components.runtime.errors import ConfigError


def _pair(env: Mapping[str, str], user_key: str, password_key: str) -> tuple[str, str] | None:
    user, password = env.get(user_key) or None, env.get(password_key) or None
    if (user is None) != (password is None):
        given, missing = (user_key, password_key) if user is not None else (password_key, user_key)
        raise ConfigError(f"{given} is set but {missing} is not: give both or neither")
    return None if user is None or password is None else (user, password)


def etcd_credentials(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``aetcd.Client``'s ``username``/``password`` keyword arguments (empty: no authentication)."""
    pair = _pair(os.environ if env is None else env, "KVMESH_ETCD_USERNAME", "KVMESH_ETCD_PASSWORD")
    return {} if pair is None else {"username": pair[0], "password": pair[1]}


def nats_credentials(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``nats.connect``'s ``user``/``password`` or ``token`` keyword arguments (empty: none beyond the URL's)."""
    env = os.environ if env is None else env
    pair = _pair(env, "KVMESH_NATS_USER", "KVMESH_NATS_PASSWORD")
    token = env.get("KVMESH_NATS_TOKEN") or None
    if pair is not None and token is not None:
        raise ConfigError("KVMESH_NATS_TOKEN and KVMESH_NATS_USER/KVMESH_NATS_PASSWORD are both set: give one")
    if token is not None:
        return {"token": token}
    return {} if pair is None else {"user": pair[0], "password": pair[1]}
