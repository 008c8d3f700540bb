"""``kvmesh planner``: scale a deployment's prefill and decode pools, on their load as Dynamo's load planner does
(``--mode load``, the default) or to TTFT and ITL targets ahead of the predicted load (``--mode sla``).

    kvmesh serve graphs/mock_agg.yaml --detach
    kvmesh planner --namespace mock --served-model-name tiny-llama --log-dir runs/planner
    kvmesh planner --mode sla --ttft 500 --itl 50 --namespace mock --served-model-name tiny-llama
    tensorboard --logdir runs/planner

Flags: this process's own (``PlannerRunConfig``: where, which model, which mode and environment, TensorBoard,
Prometheus), the load planner's (``PlannerConfig``: intervals, thresholds, GPU budget, ``--no-operation``), the SLA
planner's (``SlaPlannerConfig``: targets, predictor, start-up lead; the fields both share are one flag each, with the
chosen mode's default) and the runtime's (etcd, NATS), each derived from its pydantic model
(components/runtime/flags.py), so defaults and help live in the models (components/planner/config.py). A flag of
the other mode is refused by name.

The SLA planner's start-up lead (``--worker-startup-s``), when not given and the environment is local: the longest
start-up ``kvmesh serve`` measured for the model's worker groups (the state file's ``startup_s``), else the
config's default. Its performance model: ``--profile-results-dir`` (a ``kvmesh profile`` JSON, or a directory holding
one), else each worker's announced step-time model.

Environments: ``local`` (connectors/local.py: the circus arbiter of the ``kvmesh serve`` deployment of
``--namespace``, found through ``<state-dir>/<namespace>.json``; etcd and NATS come from that file unless given as
flags or in the environment), ``virtual`` (connectors/virtual.py: targets written to etcd for an outside system),
``kubernetes`` (connectors/kubernetes.py: the scale of the worker Deployments ``kvmesh k8s apply`` created in
``--k8s-namespace``; the pods it removes chosen from this planner's fleet view). A graph's ``planner:``
section makes ``kvmesh serve`` run this command itself, as the watcher ``<namespace>-planner``.
"""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from components.deploy.errors import DeployError
from components.deploy.state import read_state, resolve_state_dir, state_path
from components.planner.config import (
    SHARED_FIELDS,
    AnyPlannerConfig,
    Environment,
    PlannerConfig,
    PlannerRunConfig,
    SlaPlannerConfig,
    policy_config,
)
from components.planner.connectors.base import Connector
from components.planner.connectors.kubernetes import KubernetesConnector
from components.planner.connectors.local import LocalConnector
from components.planner.connectors.virtual import VirtualConnector
from components.planner.controller import PlannerController
from components.planner.loop import Planner
from components.planner.sla.controller import SlaController
from components.planner.sla_profile import load_profile_results
from components.planner.sla_warmup import warmup_series
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, given_values, model_from_args
from components.runtime.process import add_runtime_arguments, run_component

# Exit code for a valid command this build cannot run (argparse uses 2 for usage errors too).
__all__ = ["Environment", "PlannerRunConfig", "add_arguments", "configs_from_args", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_model_arguments(p, PlannerRunConfig)
    add_model_arguments(p, PlannerConfig)
    add_model_arguments(p, SlaPlannerConfig, skip=set(SHARED_FIELDS))


def configs_from_args(args: argparse.Namespace) -> tuple[PlannerRunConfig, AnyPlannerConfig]:
    try:
        run = model_from_args(PlannerRunConfig, args)
        values = given_values(PlannerConfig, args) | given_values(SlaPlannerConfig, args)
        return run, policy_config(run.mode, values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = str(err["msg"]).removeprefix("Value error, ")
            flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
            problems.append(f"{flag}: {msg}" if flag else msg)
        raise SystemExit("kvmesh planner: " + "; ".join(problems)) from None
    except ValueError as e:
        raise SystemExit(f"kvmesh planner: --{e}") from None


def measured_startup_s(run: PlannerRunConfig) -> float | None:
    """The longest worker start-up ``kvmesh serve`` recorded for the model's worker groups (state file), None when
    there is no state file or no such record."""
    try:
        st = read_state(state_path(resolve_state_dir(run.state_dir), run.namespace))
    except DeployError:
        return None
    seen = [w.startup_s for w in st.watchers if w.model == run.served_model_name and w.startup_s is not None]
    return max(seen) if seen else None


def make_controller(cfg: AnyPlannerConfig, model: str) -> PlannerController | SlaController:
    """The controller of the config's mode (the SLA planner with its profile, when one is named)."""
    if isinstance(cfg, PlannerConfig):
        return PlannerController(cfg, model)
    perf = load_profile_results(cfg.profile_results_dir) if cfg.profile_results_dir else None
    ctl = SlaController(cfg, model, perf)
    if cfg.load_predictor_warmup_trace:
        series = warmup_series(cfg.load_predictor_warmup_trace, cfg.adjustment_interval)
        ctl.warm_start(series.rates, series.isls, series.osls)
    return ctl


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
    if run.environment == Environment.LOCAL:
        try:
            endpoints_from_state(args, run)
        except DeployError as e:
            print(f"kvmesh planner: --environment local: {e}", file=sys.stderr)
            return e.exit_code
    if isinstance(cfg, SlaPlannerConfig) and "worker_startup_s" not in given_values(SlaPlannerConfig, args):
        measured = measured_startup_s(run) if run.environment == Environment.LOCAL else None
        if measured is not None:
            cfg = cfg.model_copy(update={"worker_startup_s": measured})
            print(f"kvmesh planner: start-up lead {measured:g} s, as kvmesh serve measured it", file=sys.stderr)
    try:
        controller = make_controller(cfg, run.served_model_name)
    except (OSError, ValueError) as e:  # ProfileFormatError, TraceFormatError and a short trace are ValueErrors
        print(f"kvmesh planner: --profile-results-dir / --load-predictor-warmup-trace: {e}", file=sys.stderr)
        return 2

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
        elif run.environment == Environment.KUBERNETES:
            from components.deploy.k8s_api import connect

            connector = KubernetesConnector(
                lambda: connect(run.kubeconfig),
                run.k8s_namespace,
                run.namespace,
                run.served_model_name,
                timeout_s=run.scaling_timeout_s,
            )
        else:
            connector = VirtualConnector(runtime, run.namespace, run.served_model_name, timeout_s=run.scaling_timeout_s)
        planner = Planner(
            runtime,
            cfg,
            run.namespace,
            run.served_model_name,
            connector,
            controller=controller,
            log_dir=run.log_dir,
            metrics_host=run.metrics_host,
            metrics_port=run.metrics_port,
            hand_change_timeout_s=run.scaling_timeout_s,
        )
        if isinstance(connector, KubernetesConnector):
            connector.fleet = lambda: planner.fleet.snapshot(planner.clock())  # which pods leave first
        return planner

    return eventloop.run(run_component(args, f"kvmesh-planner-{run.namespace}", build))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvmesh planner")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
