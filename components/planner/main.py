"""``kvmesh planner``: scale a deployment's prefill and decode pools on their load, as Dynamo's load planner does.

    kvmesh planner --namespace NS --served-model-name MODEL --log-dir runs/planner --environment virtual
    tensorboard --logdir runs/planner

Flags: this process's own (``PlannerRunConfig``: where, which model, which environment, TensorBoard), the policy's
(``PlannerConfig``: intervals, thresholds, GPU budget, ``--no-operation``) and the runtime's (etcd, NATS), each
derived from its pydantic model (components/runtime/flags.py), so defaults and help live in the models.

Environments: ``virtual`` (connectors/virtual.py: targets written to etcd for an outside system) works; ``local``
(circus, through state/<NS>.json) and ``kubernetes`` are not implemented yet and exit 2 saying so, before
connecting to anything.
"""

from __future__ import annotations

import argparse
import enum
import sys

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components.planner.config import PlannerConfig
from components.planner.connectors.virtual import DEFAULT_TIMEOUT_S, VirtualConnector
from components.planner.loop import Planner
from components.runtime import Runtime, eventloop
from components.runtime.flags import add_model_arguments, model_from_args
from components.runtime.process import add_runtime_arguments, run_component

# Exit code for a valid command this build cannot run (argparse uses 2 for usage errors too).
EXIT_NOT_IMPLEMENTED = 2


class Environment(enum.StrEnum):
    LOCAL = "local"  # the circus arbiter `kvmesh serve` started
    VIRTUAL = "virtual"  # an outside system answers through etcd (tests, the fleet simulator)
    KUBERNETES = "kubernetes"


class PlannerRunConfig(BaseModel):
    """Where the planner runs: the deployment, its model, how it changes the fleet and where it logs."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="kvmesh", description="Namespace of the deployment to scale.")
    served_model_name: str = Field(
        default="mock-model",
        min_length=1,
        description="Served model name whose workers are scaled (the workers' --model).",
    )
    environment: Environment = Field(
        default=Environment.LOCAL,
        description="How pools are resized: local (circus, from state/<namespace>.json; not implemented yet), "
        "virtual (target sizes written to etcd under kvmesh/<namespace>/planner/virtual/ for an outside system to "
        "apply and acknowledge), kubernetes (not implemented yet).",
    )
    log_dir: str | None = Field(
        default=None,
        description="Directory for TensorBoard event files (scalars at every pull and adjustment, decisions as "
        "text); none: no TensorBoard output.",
    )
    virtual_timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S,
        gt=0,
        description="virtual environment: seconds to wait for the outside system to report a pool size done "
        "before the change counts as failed.",
    )


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


def main(args: argparse.Namespace) -> int:
    run, cfg = configs_from_args(args)
    if run.environment != Environment.VIRTUAL:
        print(
            f"kvmesh planner: --environment {run.environment} is not implemented yet (only 'virtual' is)",
            file=sys.stderr,
        )
        return EXIT_NOT_IMPLEMENTED

    def build(runtime: Runtime) -> Planner:
        connector = VirtualConnector(runtime, run.namespace, run.served_model_name, timeout_s=run.virtual_timeout_s)
        return Planner(runtime, cfg, run.namespace, run.served_model_name, connector, log_dir=run.log_dir)

    return eventloop.run(run_component(args, f"kvmesh-planner-{run.namespace}", build))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="kvmesh planner")
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
