"""Merge the JSON reports of several ``kvmesh bench routing`` runs (the last line of each one's stdout, saved to a
file) into one: their workloads and held-out shapes side by side, the targets summarized again over all of them,
with the PNG and the Markdown tables drawn from the merged report. For a sweep run in parts (one invocation per group
of workloads, so that a slow machine finishes some of it): every part must use the same loads, policies, seeds and
fleets, or the tables would compare unlike runs.

    python scripts/merge_routing_reports.py base.json held.json mooncake.json --png docs/bench-routing.png \\
        --markdown /tmp/routing.md > merged.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from components.cli.bench import routing as rb

SAME = ("loads", "policies", "seeds", "fleets")


def merge(reports: list[dict]) -> dict:
    first = reports[0]
    for r in reports[1:]:
        for k in SAME:
            if r[k] != first[k]:
                raise SystemExit(f"reports differ in {k}: {first[k]} vs {r[k]}")
    out = {k: first[k] for k in ("bench", "rules", *SAME)}
    out["workloads"] = {n: w for r in reports for n, w in r["workloads"].items()}
    out["held_out"] = {n: w for r in reports for n, w in r["held_out"].items()}
    out["targets"] = {
        g: {f: rb.summarize_targets([v for w in out[g].values() for v in w["fleets"][f]["targets"].values()])
            for f in first["fleets"]}
        for g in ("workloads", "held_out")
    }  # fmt: skip
    out.update(
        rb.summarize_targets(
            [v for w in out["workloads"].values() for agg in w["fleets"].values() for v in agg["targets"].values()]
        )
    )
    out["wall_s"] = [r["wall_s"] for r in reports]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+")
    p.add_argument("--png", default="")
    p.add_argument("--markdown", default="")
    args = p.parse_args()
    merged = merge([json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in args.reports])
    if args.png:
        merged["png"] = rb.plot(merged, args.png)
    if args.markdown:
        Path(args.markdown).write_text(rb.markdown(merged))
    json.dump(merged, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
