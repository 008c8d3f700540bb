"""The ``--set PATH=VALUE`` flag of the commands that read a graph file (``kvmesh serve``, ``kvmesh simulate``): one
definition, in a module that imports nothing heavy (``kvmesh simulate`` must not import circus to parse it)."""

from __future__ import annotations

import argparse


def add_override_argument(p: argparse.ArgumentParser) -> None:
    """``--set PATH=VALUE`` (repeatable, into ``args.overrides``): what ``load_graph`` applies before validation."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a graph field before validation, e.g. --set frontend.port=0 --set workers[0].replicas=1 "
        "(VALUE is YAML); repeatable",
    )
