"""``kvmesh planner``: scale a deployment's prefill and decode pools on their load, as Dynamo's load planner does.

    kvmesh serve graphs/mock_agg.yaml --detach
    kvmesh planner --namespace mock --served-model-name tiny-llama --log-dir runs/planner
    tensorboard --logdir runs/planner

Flags: this process's own (``PlannerRunConfig``: where, which model, which environment, TensorBoard, Prometheus),
the policy's (``PlannerConfig``: intervals, thresholds, GPU budget, ``--no-operation``) and the runtime's (etcd,
NATS), each derived from its pydantic model (components/runtime/flags.py), so defaults and help live in the models
(components/planner/config.py).

Environments: ``local`` (connectors/local.py: the circus arbiter of the ``kvmesh serve`` deployment of
``--namespace``, found through ``<state-dir>/<namespace>.json``; etcd and NATS come from that file unless given as
flags or in the environment), ``virtual`` (connectors/virtual.py: targets written to etcd for an outside system).
``kubernetes`` is not implemented yet and exits 2 saying so, before connecting to anything. A graph's ``planner:``
section makes ``kvmesh serve`` run this command itself, as the watcher ``<namespace>-planner``.
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from components.deploy.errors import DeployError
from components.deploy.state import read_state, resolve_state_dir, state_path
from components.planner.config import Environment, PlannerConfig, PlannerRunConfig
from components.planner.connectors.base import Connector
from components.planner.connectors.local import LocalConnector
from components.planner.connectors.virtual import VirtualConnector
from components.planner.loop import Planner
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, run_component

# Exit code for a valid command this build cannot run (argparse uses 2 for usage errors too).
EXIT_NOT_IMPLEMENTED = 2
__all__ = ["Environment", "PlannerRunConfig", "add_arguments", "configs_from_args", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, PlannerRunConfig)
    add_model_arguments(p, PlannerConfig)


def configs_from_args(args: argparse.Namespace) -> tuple[PlannerRunConfig, PlannerConfig]:
    try:
        return model_from_args(PlannerRunConfig, args), model_from_args(PlannerConfig, args)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
            problems.append(f"{flag}: {msg}" if flag else msg)
        raise SystemExit("kvmesh planner: " + "; ".join(problems)) from None


def endpoints_from_state(args: argparse.Namespace, run: PlannerRunConfig) -> None:
    """local: etcd and NATS of the served deployment, from its state file, unless flags or the environment give
    them (an embedded etcd listens on a port chosen at start: only the state file knows it). Raises DeployError when
    the namespace is not served from the state dir."""
    st = read_state(state_path(resolve_state_dir(run.state_dir), run.namespace))
    if getattr(args, "etcd_endpoints", None) is None and not os.environ.get("KVMESH_ETCD_ENDPOINTS"):
        args.etcd_endpoints = list(st.etcd_endpoints)
    if getattr(args, "nats_url", None) is None and not os.environ.get("KVMESH_NATS_URL"):
        args.nats_url = st.nats_url


def main(args: argparse.Namespace) -> int:
    run, cfg = configs_from_args(args)
    if run.environment == Environment.KUBERNETES:
        print(
            f"kvmesh planner: --environment {run.environment} is not implemented yet (local and virtual are)",
            file=sys.stderr,
        )
        return EXIT_NOT_IMPLEMENTED
    if run.environment == Environment.LOCAL:
        try:
            endpoints_from_state(args, run)
        except DeployError as e:
            print(f"kvmesh planner: --environment local: {e}", file=sys.stderr)
            return e.exit_code

    def build(runtime: Runtime) -> Planner:
        connector: Connector
        if run.environment == Environment.LOCAL:
            connector = LocalConnector(
                runtime,
                run.namespace,
                run.served_model_name,
                resolve_state_dir(run.state_dir),
                start_timeout_s=run.scaling_timeout_s,
            )
        else:
            connector = VirtualConnector(runtime, run.namespace, run.served_model_name, timeout_s=run.scaling_timeout_s)
        return Planner(
            runtime,
            cfg,
            run.namespace,
            run.served_model_name,
            connector,
            log_dir=run.log_dir,
            metrics_host=run.metrics_host,
            metrics_port=run.metrics_port,
        )

    return eventloop.run(run_component(args, f"kvmesh-planner-{run.namespace}", build))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvmesh planner")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
