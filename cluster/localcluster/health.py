"""Wait for a component to answer, and say which one did not, with the end of its log."""

from __future__ import annotations

import socket
import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from . import processes
from .layout import log_path


class ComponentFailed(RuntimeError):
    pass


# Lines every log repeats on this machine and that say nothing about a failure: the controllers cannot publish
# Service endpoints at the pods' address, 127.0.0.1 (every pod shares this machine's loopback).
EXPECTED_NOISE = ("may not be in the loopback range",)


def log_tail(component: str, lines: int = 30) -> str:
    try:
        text = log_path(component).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    kept = [line for line in text.splitlines() if not any(noise in line for noise in EXPECTED_NOISE)]
    return "\n".join(kept[-lines:])


def wait(component: str, check: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll check() until it is true; fail early if the component's process exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if component in processes.names() and processes.running_pid(component) is None:
            raise ComponentFailed(f"{component} exited before {what}; end of {log_path(component)}:\n{log_tail(component)}")
        if time.monotonic() > deadline:
            raise ComponentFailed(
                f"{component}: no {what} after {timeout:.0f} s; end of {log_path(component)}:\n{log_tail(component)}"
            )
        time.sleep(0.25)


def tcp_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def port_in_use(host: str, port: int) -> bool:
    return tcp_open(host, port)


def https_ok(url: str, *, ca: Path, cert: Path | None = None, key: Path | None = None) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    if cert:
        context.load_cert_chain(str(cert), str(key))
    with urllib.request.urlopen(url, context=context, timeout=3) as response:
        return response.status == 200


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as response:
        return response.status < 400
