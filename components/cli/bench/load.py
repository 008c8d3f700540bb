"""``kvmesh bench load``: load any OpenAI-compatible endpoint (kvmesh, ``vllm serve``, Dynamo, ...) and print JSON.

Fixed concurrency with synthetic token-id prompts or ShareGPT texts, or a Mooncake/Azure trace replayed on its
timestamps (``--time-scale 0.1`` = 10x faster); always bounded by ``--max-requests`` and ``--duration-s``. The last
line on stdout is one JSON object (requests/s, tokens/s, TTFT/ITL/E2E percentiles, errors by kind, CPU-ms per request
of ``--pids`` and of the load generator); ``--output FILE`` writes it too. A progress bar goes to stderr.

Examples::

    kvmesh bench load --model tiny-llama --concurrency 64 --prompt-tokens 1200 --max-tokens 64
    kvmesh bench load --model tiny-llama --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --time-scale 0.1 --max-requests 500 --max-input-tokens 1900 --max-output-tokens 64

Flags come from ``loadgen.config.LoadConfig``; the loop itself is ``loadgen.run_load``. Exit status: 0 when at least
one request completed, 1 when none did (the JSON is printed either way), 2 for a bad configuration or trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from components.cli.bench.loadgen import LoadConfig, LoadgenError, TraceFormatError, run_load
from components.runtime.flags import add_model_arguments, model_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=LoadConfig.model_fields["model"].description)
    p.add_argument("--output", default=None, help="also write the JSON result to this file")
    add_model_arguments(p, LoadConfig, skip={"model"})


def main(args: argparse.Namespace) -> int:
    try:
        cfg = model_from_args(LoadConfig, args)
        result = asyncio.run(run_load(cfg))
    except ValidationError as e:
        print(f"kvmesh bench load: invalid options:\n{e}", file=sys.stderr)
        return 2
    except (LoadgenError, TraceFormatError) as e:
        print(f"kvmesh bench load: {e}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    if args.output:
        Path(args.output).write_text(line + "\n", encoding="utf-8")
    print(line, flush=True)
    return 0 if result["requests_completed"] else 1
