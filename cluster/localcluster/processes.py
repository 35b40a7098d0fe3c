"""Start components as background processes with their own log files; stop exactly those, by pid.

Each process leads its own session (so a terminal's Ctrl-C does not reach it) and its pid and start
time are written to state/pids/NAME. `stop` signals only a pid whose start time still matches, so a
recycled pid is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from .layout import log_path, state_dir


def _pid_file(name: str) -> Path:
    return state_dir() / "pids" / name


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[19]  # field 22 (starttime), counted after the command name


def start(name: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    log = log_path(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    _pid_file(name).parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n==> {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        out.flush()
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,
        )
    _pid_file(name).write_text(json.dumps({"pid": process.pid, "start": _start_time(process.pid), "argv": argv}))
    return process.pid


def running_pid(name: str) -> int | None:
    """The pid of component NAME if the process `start` made is still alive."""
    try:
        record = json.loads(_pid_file(name).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    pid = record["pid"]
    if _start_time(pid) != record["start"]:
        return None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    return None if state == "Z" else pid


def stop(name: str, *, grace: float = 20.0) -> bool:
    """SIGTERM the component's process group, SIGKILL it after `grace` seconds; True if it was running."""
    pid = running_pid(name)
    if pid is None:
        _pid_file(name).unlink(missing_ok=True)
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and running_pid(name) == pid:
        _reap(pid)
        time.sleep(0.1)
    if running_pid(name) == pid:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while running_pid(name) == pid:
            _reap(pid)
            time.sleep(0.05)
    _pid_file(name).unlink(missing_ok=True)
    return True


def _reap(pid: int) -> None:
    """Collect an exited child of this process (when `up` and `down` run in one process, as in tests)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def names() -> list[str]:
    folder = state_dir() / "pids"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
