"""The engine group's processes on this host, as the web page's engine panel lists them: role,
pid, uptime and restart count.

The launcher starts every role as its child (`python -m pagedserve.pipeline.<role>.process
--rank N`), so the ingress finds its siblings under its parent in /proc; the restart counts are
the scheduler's (its stats' `restarts`, by role: a worker group's restart counts once for
"worker"). Worker ranks on other hosts (--nnodes > 1) are not seen from here.
"""
from __future__ import annotations

import os
from typing import Any

_ROLE_MODULES = {"pagedserve.pipeline.scheduler.process": "scheduler",
                 "pagedserve.workers.process": "worker",
                 "pagedserve.pipeline.detokenizer.process": "detokenizer",
                 "pagedserve.pipeline.ingress.process": "ingress"}
_LAUNCHER_MODULE = "pagedserve.pipeline.launch"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # gone since it was listed, or not ours to read
        return None


def _cmdline(pid: int) -> list[str]:
    raw = _read(f"/proc/{pid}/cmdline")
    return raw.rstrip("\0").split("\0") if raw else []


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 is index 0."""
    raw = _read(f"/proc/{pid}/stat")
    return raw[raw.rfind(")") + 2:].split() if raw else None


def uptime_s(pid: int) -> float | None:
    fields, boot = _stat_fields(pid), _read("/proc/uptime")
    if fields is None or boot is None:
        return None
    return max(0.0, float(boot.split()[0]) - int(fields[19]) / _CLOCK_TICKS)


def children_of(pid: int) -> list[int]:
    """Child pids: the kernel's list per thread, else a scan of /proc for the parent's pid."""
    found: list[int] = []
    tasks = f"/proc/{pid}/task"
    try:
        for tid in os.listdir(tasks):
            listed = _read(f"{tasks}/{tid}/children")
            if listed is None:
                raise OSError("no children file (CONFIG_PROC_CHILDREN off)")
            found += [int(p) for p in listed.split()]
        return found
    except OSError:
        pass
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(int(name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(name))
    return found


def role_of(cmdline: list[str]) -> tuple[str, int] | None:
    """(role, rank) of one of our role processes by its command line; None for any other."""
    if "-m" not in cmdline:
        return None
    at = cmdline.index("-m") + 1
    role = _ROLE_MODULES.get(cmdline[at] if at < len(cmdline) else "")
    if role is None:
        return None
    rank = cmdline[cmdline.index("--rank") + 1] if "--rank" in cmdline else "0"
    return role, int(rank) if rank.isdigit() else 0


def _row(name: str, role: str, pid: int, restarts: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "role": role, "pid": pid, "uptime_s": uptime_s(pid),
            "restarts": int(restarts.get(role, 0))}


def group_processes(restarts: dict[str, Any], launcher_pid: int | None = None
                    ) -> list[dict[str, Any]]:
    """The launcher and its role processes, launcher first then by role and rank."""
    launcher_pid = os.getppid() if launcher_pid is None else launcher_pid
    rows = []
    if _LAUNCHER_MODULE in _cmdline(launcher_pid):
        rows.append(_row("launcher", "launcher", launcher_pid, {}))
    order, found = list(_ROLE_MODULES.values()), []
    for pid in children_of(launcher_pid):
        known = role_of(_cmdline(pid))
        if known is not None:
            found.append((order.index(known[0]), known[1], known[0], pid))
    for _, rank, role, pid in sorted(found):
        rows.append(_row(f"worker{rank}" if role == "worker" else role, role, pid, restarts))
    return rows
