"""The machine a benchmark ran on, described once: CPU model (/proc/cpuinfo), cores, Python, torch."""

from __future__ import annotations

import os
import platform
import sys


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where that is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict:
    """Host, CPU model, logical CPUs, OS, Python, and torch's version if the benchmark imported torch (None
    otherwise: describing the machine never imports it)."""
    torch = sys.modules.get("torch")
    return {"host": platform.node(), "arch": platform.machine(), "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": getattr(torch, "__version__", None)}


def describe(m: dict | None = None) -> str:
    """One line for a table's title: ``host: 16 cores, <cpu>, Python 3.11.7[, torch 2.x]``."""
    m = m or machine()
    line = f"{m['host']}: {m['logical_cpus']} cores, {m['cpu']}, Python {m['python']}"
    return line + (f", torch {m['torch']}" if m.get("torch") else "")
