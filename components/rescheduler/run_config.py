"""``ReschedulerRunConfig``: where a standalone rescheduler (``kvmesh rescheduler``) runs and reports, apart from how
it decides (``ReschedulerConfig``, config.py). Its flags are derived from it (components/runtime/flags.py), as the
planner's ``PlannerRunConfig``'s are.

Imports: pydantic and the standard library.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ReschedulerRunConfig(BaseModel):
    """Where the rescheduler runs: the deployment, the workers' component and where it reports."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(default="kvmesh", description="Namespace of the deployment whose workers it moves.")
    component: str = Field(
        default="backend",
        min_length=1,
        description="Component the workers register under (the workers' --component): whose migrate endpoints it "
        "calls.",
    )
    state_dir: str | None = Field(
        default=None,
        description="The directory of kvmesh serve's state files (unset: $KVMESH_STATE_DIR, else ./state): etcd and "
        "NATS endpoints are read from <state-dir>/<namespace>.json when that file exists, unless given as flags or "
        "in the environment.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address of the rescheduler's Prometheus endpoint (GET /metrics); loopback unless said otherwise.",
    )
    metrics_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="TCP port of the rescheduler's Prometheus endpoint; 0: a free port, announced on the READY line "
        "and by `kvmesh status`.",
    )


def flag_problems(e: ValidationError) -> str:
    """A config's validation errors as the flags that caused them, ``--flag: message``, one after the other."""
    out = []
    for err in e.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else ""
        out.append(f"{flag}: {msg}" if flag else msg)
    return "; ".join(out)
