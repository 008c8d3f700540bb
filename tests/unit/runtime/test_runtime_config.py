"""Runtime configuration, names, discovery records and the wire codec (config.py, runtime.py, codec.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from components.runtime import ConfigError, FatalError, InstanceInfo, Runtime, RuntimeConfig
from components.runtime.codec import pack, unpack
from components.runtime.config import DEFAULT_ETCD_ENDPOINT, DEFAULT_NATS_URL, parse_host_port
from components.runtime.memory import MemoryBus, MemoryDiscovery, MemoryStore
from components.runtime.runtime import instances_prefix

pytestmark = pytest.mark.unit

ENV_VARS = ("KVMESH_ETCD_ENDPOINTS", "KVMESH_NATS_URL", "KVMESH_LEASE_TTL_S")


@pytest.fixture
def clean_env(monkeypatch):
    """No KVMESH_* variable from the developer's shell leaks into a test."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- RuntimeConfig.from_env ----------------------------------------------------------------------------------------


def test_defaults_bind_to_loopback(clean_env):
    cfg = RuntimeConfig.from_env()
    assert cfg.etcd_endpoints == [DEFAULT_ETCD_ENDPOINT] == ["http://127.0.0.1:2379"]
    assert cfg.nats_url == DEFAULT_NATS_URL == "nats://127.0.0.1:4222"
    assert cfg.lease_ttl_s == 10
    assert cfg == RuntimeConfig()


def test_environment_overrides_defaults(clean_env):
    clean_env.setenv("KVMESH_ETCD_ENDPOINTS", " http://10.0.0.1:2379 ,http://10.0.0.2:22379,, ")
    clean_env.setenv("KVMESH_NATS_URL", "nats://bus.internal:4333")
    clean_env.setenv("KVMESH_LEASE_TTL_S", "7")
    cfg = RuntimeConfig.from_env()
    assert cfg.etcd_endpoints == ["http://10.0.0.1:2379", "http://10.0.0.2:22379"]  # trimmed, empties dropped
    assert cfg.nats_url == "nats://bus.internal:4333"
    assert cfg.lease_ttl_s == 7
    # Everything the environment does not name keeps its default.
    assert cfg.stream_idle_probe_s == RuntimeConfig().stream_idle_probe_s


def test_explicit_overrides_beat_the_environment_and_none_means_not_given(clean_env):
    clean_env.setenv("KVMESH_NATS_URL", "nats://from-env:4222")
    clean_env.setenv("KVMESH_LEASE_TTL_S", "7")
    cfg = RuntimeConfig.from_env(nats_url="nats://from-flag:4222", lease_ttl_s=None, probe_timeout_s=0.25)
    assert cfg.nats_url == "nats://from-flag:4222"
    assert cfg.lease_ttl_s == 7  # None did not override
    assert cfg.probe_timeout_s == 0.25


def test_empty_variables_are_ignored(clean_env):
    for name in ENV_VARS:
        clean_env.setenv(name, "")
    assert RuntimeConfig.from_env() == RuntimeConfig()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("http://:2379", "has no host"),
        ("http://etcd:99999", "does not parse"),
        ("http://ok:2379,nats://", "has no host"),
    ],
)
def test_bad_etcd_endpoint_is_a_config_error_naming_it(clean_env, value, needle):
    clean_env.setenv("KVMESH_ETCD_ENDPOINTS", value)
    with pytest.raises(ConfigError) as exc:
        RuntimeConfig.from_env()
    assert needle in str(exc.value)
    assert isinstance(exc.value, FatalError)


def test_etcd_endpoints_of_only_separators_is_a_config_error(clean_env):
    clean_env.setenv("KVMESH_ETCD_ENDPOINTS", " , ,")
    with pytest.raises(ConfigError, match="at least one etcd endpoint"):
        RuntimeConfig.from_env()


def test_bad_nats_url_is_a_config_error(clean_env):
    clean_env.setenv("KVMESH_NATS_URL", "nats://:4222")
    with pytest.raises(ConfigError, match="'nats://:4222' has no host"):
        RuntimeConfig.from_env()


@pytest.mark.parametrize("value", ["ten", "2.5", "10s"])
def test_ttl_that_is_not_an_integer_is_a_config_error_naming_the_variable(clean_env, value):
    """Regression: ``int("ten")`` escaped from_env as a bare ValueError that named no variable."""
    clean_env.setenv("KVMESH_LEASE_TTL_S", value)
    with pytest.raises(ConfigError) as exc:
        RuntimeConfig.from_env()
    assert "KVMESH_LEASE_TTL_S" in str(exc.value) and repr(value) in str(exc.value)


@pytest.mark.parametrize("value", ["1", "0", "-5"])
def test_ttl_below_two_seconds_is_a_config_error(clean_env, value):
    # Keep-alives go every TTL/3; below 2 s a single late keep-alive would drop a healthy instance.
    clean_env.setenv("KVMESH_LEASE_TTL_S", value)
    with pytest.raises(ConfigError) as exc:
        RuntimeConfig.from_env()
    assert "lease_ttl_s" in str(exc.value) and "greater than or equal to 2" in str(exc.value)


def test_direct_construction_validates_endpoints_too():
    with pytest.raises(ConfigError, match="has no host"):
        RuntimeConfig(etcd_endpoints=["http://:1"])
    with pytest.raises(ValueError, match="request_ack_timeout_s"):
        RuntimeConfig(request_ack_timeout_s=0)


# -- parse_host_port -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "default", "expected"),
    [
        ("http://127.0.0.1:2379", 1, ("127.0.0.1", 2379)),
        ("nats://bus:4333", 4222, ("bus", 4333)),
        ("nats://bus", 4222, ("bus", 4222)),  # port omitted: the default
        ("etcd-0.etcd:2380", 2379, ("etcd-0.etcd", 2380)),  # no scheme
        ("etcd-0", 2379, ("etcd-0", 2379)),
        ("[::1]:4222", 1, ("::1", 4222)),
        ("http://[fe80::1]:2379", 1, ("fe80::1", 2379)),
    ],
)
def test_parse_host_port(url, default, expected):
    assert parse_host_port(url, default_port=default) == expected


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://", "has no host"),
        ("", "has no host"),
        (":4222", "has no host"),
        ("host:port", "does not parse"),
        ("host:70000", "does not parse"),
    ],
)
def test_parse_host_port_rejects_with_the_endpoint_in_the_message(url, needle):
    with pytest.raises(ConfigError) as exc:
        parse_host_port(url, default_port=1)
    assert needle in str(exc.value) and repr(url) in str(exc.value)


# -- names -----------------------------------------------------------------------------------------------------------


@pytest.fixture
async def runtime():
    rt = await Runtime.from_parts(RuntimeConfig(), MemoryDiscovery(MemoryStore()), MemoryBus())
    yield rt
    await rt.shutdown()


@pytest.mark.parametrize("bad", ["bad.name", "", "a/b", "with space", "x" * 65, "star*", "gt>", "ünï"])
async def test_bad_names_are_refused_at_every_level(runtime, bad):
    # '.' would split a NATS subject token and '/' an etcd key segment; '*' and '>' are NATS wildcards.
    with pytest.raises(ConfigError) as exc:
        runtime.namespace(bad)
    assert repr(bad) in str(exc.value) and "namespace" in str(exc.value)
    ns = runtime.namespace("ns")
    with pytest.raises(ConfigError, match="component name"):
        ns.component(bad)
    with pytest.raises(ConfigError, match="endpoint name"):
        ns.component("c").endpoint(bad)
    with pytest.raises(ConfigError, match="queue name"):
        await ns.work_queue(bad)


@pytest.mark.parametrize("good", ["a", "A-b_9", "x" * 64, "0"])
async def test_good_names_build_subjects_and_keys(runtime, good):
    ep = runtime.namespace(good).component(good).endpoint(good)
    assert ep.path == f"{good}/{good}/{good}"
    assert ep._subject(0xBEEF) == f"kvmesh.{good}.{good}.{good}.beef"
    assert instances_prefix(good, good, good) == f"kvmesh/{good}/instances/{good}/{good}/"


def test_instances_prefix_narrows_by_level():
    assert instances_prefix("ns") == "kvmesh/ns/instances/"
    assert instances_prefix("ns", "c") == "kvmesh/ns/instances/c/"
    assert instances_prefix("ns", "c", "e") == "kvmesh/ns/instances/c/e/"
    assert instances_prefix("ns", None, "e") == "kvmesh/ns/instances/"  # an endpoint without a component is ignored


# -- InstanceInfo ----------------------------------------------------------------------------------------------------


def test_instance_info_json_round_trip():
    info = InstanceInfo(
        namespace="ns",
        component="backend",
        endpoint="generate",
        instance_id=2**63 - 1,  # the largest id the runtime draws (randbits(63)); JSON keeps it exact
        subject="kvmesh.ns.backend.generate.7fffffffffffffff",
        metadata={"model": "tiny", "role": "decode", "gpus": [0, 1], "limits": {"max_batch": 8}, "ok": True},
    )
    data = info.to_json()
    assert isinstance(data, bytes)
    decoded = json.loads(data)
    assert decoded["instance_id"] == 2**63 - 1 and decoded["metadata"]["limits"] == {"max_batch": 8}
    assert InstanceInfo.from_json(data) == info


def test_instance_info_from_json_tolerates_missing_metadata_and_string_ids():
    record = {"namespace": "n", "component": "c", "endpoint": "e", "instance_id": "42", "subject": "s"}
    assert InstanceInfo.from_json(json.dumps(record).encode()) == InstanceInfo("n", "c", "e", 42, "s", {})
    record |= {"metadata": None}
    assert InstanceInfo.from_json(json.dumps(record).encode()).metadata == {}


# -- codec -----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Chunk:
    request_id: str
    token_ids: list[int]
    finished: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Chunk:
        return cls(**d)


def test_codec_packs_dataclasses_through_to_dict():
    chunk = Chunk("r1", [1, 2, 3], finished=True)
    assert unpack(pack(chunk)) == {"request_id": "r1", "token_ids": [1, 2, 3], "finished": True}
    assert Chunk.from_dict(unpack(pack(chunk))) == chunk
    # Nested inside the request plane's frames, as a handler's yielded item travels.
    assert unpack(pack([7, 1, chunk])) == [7, 1, chunk.to_dict()]
    assert unpack(pack({"items": [chunk, chunk]})) == {"items": [chunk.to_dict()] * 2}


def test_codec_keeps_bytes_ints_and_int_keys():
    value = {"blob": b"\x00\xff", 3: "int key", "big": 2**64 - 1, "neg": -(2**63), "f": 0.5, "none": None}
    assert unpack(pack(value)) == value
    assert isinstance(unpack(pack(b"x")), bytes)  # bin type, not str
    assert isinstance(unpack(pack("x")), str)


def test_codec_refuses_objects_without_to_dict():
    with pytest.raises(AttributeError, match="to_dict"):
        pack(object())
