"""Process life: a role dies with its driver, and a run's leftovers die with it (ipc sockets and slot files
a driver killed with kill -9 could not remove are swept by the next run).

    token = new_token()          # names the run's ipc sockets and slot files, carries the driver's pid
    die_with_parent(driver_pid)  # in a role process: SIGTERM when the driver exits
    sweep_leftovers()            # at a run's start: remove what dead runs left
    run_leftovers(driver_pid)    # what one run's driver left (what a check after a run looks for)
    process_tree(pid)            # a process and every process below it
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import secrets
import signal
import sys
import tempfile
from pathlib import Path

from tianji.runtime.transport.shm import shm_root

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def new_token() -> str:
    """A run's token; it names the run's ipc sockets and slot files and carries the driver's pid,
    so that a later run can tell leftovers of a dead driver (see `sweep_leftovers`)."""
    return f"{secrets.token_hex(4)}p{os.getpid()}"


_LEFTOVER = re.compile(r"^tianji-[0-9a-f]+p(\d+)-")


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie its parent has not reaped yet has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie has exited
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftover_folders() -> set[Path]:
    return {shm_root(), Path(tempfile.gettempdir())}


def run_leftovers(driver_pid: int) -> list[Path]:
    """The ipc sockets and slot files of the run whose driver is (or was) `driver_pid`."""
    return sorted(path for folder in _leftover_folders() for path in folder.glob(f"tianji-*p{driver_pid}-*"))


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone while read
            continue
    tree = [pid]
    for parent in tree:
        tree += [child for child, of in parents.items() if of == parent]
    return tree


def limit_file_size(pid: int, soft: int) -> None:
    """RLIMIT_FSIZE of `pid` and every process below it, set from outside (prlimit, no privilege needed):
    0 and each write fails with EFBIG, as on a full disk (the fault tests and the chaos benchmark);
    resource.RLIM_INFINITY lifts it."""
    for process in process_tree(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            _, hard = resource.prlimit(process, resource.RLIMIT_FSIZE)
            resource.prlimit(process, resource.RLIMIT_FSIZE, (soft, hard))


def sweep_leftovers() -> list[Path]:
    """Remove ipc sockets and slot files of runs whose processes are all gone (a driver killed with
    kill -9 cannot clean up); names carry the driver's pid and, for slot files, the owner's."""
    removed = []
    for folder in _leftover_folders():
        for path in folder.glob("tianji-*"):
            match = _LEFTOVER.match(path.name)
            if match is None:
                continue
            pids = [int(match.group(1)), *(int(p) for p in re.findall(r"pid(\d+)", path.name[match.end() :]))]
            if any(pid_alive(pid) for pid in pids):
                continue
            try:
                path.unlink()
                removed.append(path)
            except OSError:  # another user's, or gone already
                pass
    return removed


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: the kernel sends this process SIGTERM when its parent (the driver) exits, kill -9 included.
    `parent_pid=None` when the driver is not the parent (other launchers rely on the heartbeat)."""
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the driver died before the signal was armed
        raise SystemExit(f"driver {parent_pid} is gone")
