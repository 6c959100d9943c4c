"""Energy over a run, from counters the hardware keeps; never an estimate.

Sources, in order: Intel/AMD RAPL through powercap (``/sys/class/powercap/intel-rapl:N/energy_uj``, the
package domains, wrap-around handled with ``max_energy_range_uj``) and NVIDIA NVML
(``nvmlDeviceGetTotalEnergyConsumption``, millijoules since driver load) where ``pynvml`` imports and sees a
GPU. When neither is readable the result is the string ``"not measured"`` with the reason next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

NOT_MEASURED = "not measured"
POWERCAP = Path("/sys/class/powercap")


@dataclass(slots=True)
class _Rapl:
    domains: list[Path] = field(default_factory=list)

    @classmethod
    def find(cls, root: Path = POWERCAP) -> tuple[_Rapl | None, str]:
        if not root.is_dir():
            return None, f"{root} does not exist (no powercap driver, or a VM/container without it)"
        # package domains are intel-rapl:N; their sub-domains (intel-rapl:N:M) are already included in them
        domains = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)
        readable = [p for p in domains if _read_int(p / "energy_uj") is not None]
        if not readable:
            return None, f"no readable {root}/intel-rapl:*/energy_uj (found {len(domains)} domains; reading " \
                         f"usually needs root since CVE-2020-8694)"
        return cls(readable), ""

    def read(self) -> list[int]:
        return [_read_int(p / "energy_uj") or 0 for p in self.domains]

    def joules(self, start: list[int], end: list[int]) -> float:
        total = 0
        for p, a, b in zip(self.domains, start, end, strict=True):
            span = b - a
            if span < 0:  # the counter wrapped
                span += _read_int(p / "max_energy_range_uj") or 0
            total += span
        return total / 1e6


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class _Nvml:
    def __init__(self, nvml, handles: list):
        self.nvml, self.handles = nvml, handles

    @classmethod
    def find(cls) -> tuple[_Nvml | None, str]:
        try:
            import pynvml
        except ImportError:
            return None, "pynvml is not installed"
        try:
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            for h in handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        except pynvml.NVMLError as exc:
            return None, f"NVML unavailable: {exc}"
        if not handles:
            return None, "NVML sees no GPU"
        return cls(pynvml, handles), ""

    def read(self) -> list[int]:
        return [self.nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]

    @staticmethod
    def joules(start: list[int], end: list[int]) -> float:
        return sum(b - a for a, b in zip(start, end, strict=True)) / 1e3


class EnergyMeter:
    """``m.start()`` ... ``m.stop()`` (or ``with EnergyMeter() as m:``); then ``m.result()`` for summary.json."""

    def __init__(self) -> None:
        self._sources: list[tuple[str, object]] = []
        self._reasons: list[str] = []
        self._start: list[list[int]] = []
        self._end: list[list[int]] = []

    def start(self) -> None:
        if not self._sources and not self._reasons:
            for name, finder in (("rapl", _Rapl.find), ("nvml", _Nvml.find)):
                source, reason = finder()
                if source is None:
                    self._reasons.append(f"{name}: {reason}")
                else:
                    self._sources.append((name, source))
        self._start, self._end = [s.read() for _, s in self._sources], []

    def stop(self) -> None:
        if not self._end:
            self._end = [s.read() for _, s in self._sources]

    def __enter__(self) -> EnergyMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def result(self) -> dict:
        if not self._sources or not self._end:
            return {"joules": NOT_MEASURED, "reason": "; ".join(self._reasons) or "meter never ran"}
        spans = zip(self._sources, self._start, self._end, strict=True)
        parts = {name: round(s.joules(a, b), 3) for (name, s), a, b in spans}
        return {"joules": round(sum(parts.values()), 3), "by_source": parts,
                "scope": "whole machine (package / GPU counters), not just this run's processes"}
