"""``kvmesh rescheduler``: move running requests between a deployment's workers, every
``--rescheduling-interval-ms``, by Llumnix's policies (docs/rescheduler.md).

    kvmesh serve graphs/mock_agg.yaml --detach
    kvmesh rescheduler --namespace mock --rescheduling-policies decode_load,neutral_failover

Flags: this process's own (``ReschedulerRunConfig``: namespace, the workers' component, state dir, Prometheus),
the policies' (``ReschedulerConfig``, less ``--enable-rescheduling`` and ``--colocated-rescheduling-mode``: running
this command is the standalone mode) and the runtime's (etcd, NATS), each derived from its pydantic model
(components/runtime/flags.py). etcd and NATS come from the flags or the environment, else from the state file of a
``kvmesh serve`` deployment of ``--namespace`` when there is one (an embedded etcd listens on a port chosen at start).

Prints ``READY rescheduler NS (standalone), metrics URL`` once its loop runs, ``STOPPED`` after SIGTERM/SIGINT. A
graph's ``rescheduler:`` section makes ``kvmesh serve`` run this command as the watcher ``<namespace>-rescheduler``;
``kvmesh frontend --enable-rescheduling --colocated-rescheduling-mode`` runs the same loop inside the frontend
(components/cli/frontend.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from components.deploy.errors import DeployError
from components.deploy.state import read_state, resolve_state_dir, state_path
from components.rescheduler.config import ReschedulerConfig
from components.rescheduler.loop import Rescheduler
from components.rescheduler.run_config import ReschedulerRunConfig, flag_problems
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, run_component

# The two switches that say where a rescheduler runs; this command is the standalone one.
NOT_STANDALONE = {"enable_rescheduling", "colocated_rescheduling_mode"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, ReschedulerRunConfig)
    add_model_arguments(p, ReschedulerConfig, skip=NOT_STANDALONE)


def configs_from_args(args: argparse.Namespace) -> tuple[ReschedulerRunConfig, ReschedulerConfig]:
    try:
        return model_from_args(ReschedulerRunConfig, args), model_from_args(ReschedulerConfig, args)
    except ValidationError as e:
        raise SystemExit("kvmesh rescheduler: " + flag_problems(e)) from None


def endpoints_from_state(args: argparse.Namespace, run: ReschedulerRunConfig) -> None:
    """etcd and NATS of a served deployment of the namespace, from its state file, unless flags or the environment
    give them; nothing when no such file exists (the runtime's defaults then)."""
    if (getattr(args, "etcd_endpoints", None) or os.environ.get("KVMESH_ETCD_ENDPOINTS")) and (
        getattr(args, "nats_url", None) or os.environ.get("KVMESH_NATS_URL")
    ):
        return
    path = state_path(resolve_state_dir(run.state_dir), run.namespace)
    if not path.exists():
        return
    st = read_state(path)
    if getattr(args, "etcd_endpoints", None) is None and not os.environ.get("KVMESH_ETCD_ENDPOINTS"):
        args.etcd_endpoints = list(st.etcd_endpoints)
    if getattr(args, "nats_url", None) is None and not os.environ.get("KVMESH_NATS_URL"):
        args.nats_url = st.nats_url


def main(args: argparse.Namespace) -> int:
    run, cfg = configs_from_args(args)
    try:
        endpoints_from_state(args, run)
    except DeployError as e:
        print(f"kvmesh rescheduler: {e}", file=sys.stderr)
        return e.exit_code

    def build(runtime: Runtime) -> Rescheduler:
        return Rescheduler.from_config(
            runtime,
            run.namespace,
            cfg,
            where="standalone",
            component=run.component,
            metrics_host=run.metrics_host,
            metrics_port=run.metrics_port,
        )

    return eventloop.run(run_component(args, f"kvmesh-rescheduler-{run.namespace}", build))
