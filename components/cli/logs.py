"""``kvmesh logs NAME [-f]``: print, or follow, ``<state_dir>/logs/NAME.log`` (a watcher, or ``<ns>.serve``).

Watchers are named ``<namespace>-frontend`` and ``<namespace>-<group>-<i>``; the short name (``frontend``,
``mock-0``) works too when exactly one log in the state dir ends with it.

Following survives rotation (circus rotates a log at 64 MiB; ``kvmesh serve`` moves the previous run's aside at
start): when the file is replaced or truncated, it is reopened from its beginning.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import BinaryIO

from components.deploy.errors import DeployError, NotServingError
from components.deploy.local import ServeConfig
from components.deploy.state import log_dir, log_path, resolve_state_dir

FOLLOW_POLL_S = 0.2  # how soon a new line shows up when following


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name",
        help="watcher name (<namespace>-frontend, <namespace>-<group>-<i>, or just frontend / <group>-<i> when one "
        "deployment has it) or <namespace>.serve for a detached serve",
    )
    p.add_argument("-f", "--follow", action="store_true", help="keep printing lines as they are written (Ctrl-C ends)")
    p.add_argument("-n", "--tail", type=int, default=None, help="start with only the last N lines (default: all)")
    p.add_argument("--state-dir", default=None, help=ServeConfig.model_fields["state_dir"].description)


def main(args: argparse.Namespace) -> int:
    try:
        path = find_log(resolve_state_dir(args.state_dir), args.name)
        with open(path, "rb") as f:
            print_existing(f, args.tail, sys.stdout.buffer)
            if args.follow:
                follow(path, f, sys.stdout.buffer)
    except DeployError as e:
        print(f"kvmesh logs: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


def find_log(state_dir: Path, name: str) -> Path:
    path = log_path(state_dir, name)
    if path.is_file():
        return path
    known = sorted(p.name.removesuffix(".log") for p in log_dir(state_dir).glob("*.log"))
    short = [k for k in known if k.endswith("-" + name)]
    if len(short) == 1:
        return log_path(state_dir, short[0])
    if len(short) > 1:
        raise NotServingError(f"log {name!r}", f"several deployments have one: {', '.join(short)}; name one of them")
    raise NotServingError(f"log {name!r}", f"no {path}; logs here: {', '.join(known) or 'none'}")


def print_existing(f: BinaryIO, tail: int | None, out: BinaryIO) -> None:
    if tail is None:
        while chunk := f.read(1 << 16):
            out.write(chunk)
    else:
        for line in deque(f, maxlen=max(tail, 0)):
            out.write(line)
    out.flush()


def follow(path: Path, f: BinaryIO, out: BinaryIO, stop_after_s: float | None = None) -> None:
    """Print what is appended to ``path`` until interrupted (or ``stop_after_s``, for tests)."""
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    inode = os.fstat(f.fileno()).st_ino
    while deadline is None or time.monotonic() < deadline:
        chunk = f.read(1 << 16)
        if chunk:
            out.write(chunk)
            out.flush()
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:  # between a rotation's rename and the new file's creation
            st = None
        if st is not None and (st.st_ino != inode or st.st_size < f.tell()):
            f.close()
            f = open(path, "rb")  # closed at the next rotation, or at the end
            inode = os.fstat(f.fileno()).st_ino
            continue
        time.sleep(FOLLOW_POLL_S)
    f.close()
