"""Memory readers for the budget controller: NVML, the CPU fallback, and a scripted fake.

A reader turns a replica's engine stats (``LLMEngine.stats``) into a
:class:`autoscale.budget.MemoryReading`:

- :class:`NVMLReader`: device memory of the replica's GPUs (``nvmlDeviceGetMemoryInfo``, summed
  over the devices it uses). Any NVML error (no driver, a lost GPU) is logged once and the reader
  falls back to :class:`CPUReader` from then on.
- :class:`CPUReader`: a machine without a GPU driver: the KV pool's exact bytes held over its
  size (what the KV budget controls), and the process's resident memory via psutil (reported only).
- :class:`ScriptedReader`: a fixed sequence of memory fractions (tests, drills).
"""

from __future__ import annotations

import json
import logging
import os

from autoscale.budget import MemoryReading

log = logging.getLogger(__name__)


class CPUReader:
    source = "cpu"

    def read(self, stats: dict) -> MemoryReading:
        import psutil
        return MemoryReading(int(stats["kv_bytes_used"]), int(stats["kv_bytes_max"]), "cpu",
                             psutil.Process().memory_info().rss)


class NVMLReader:
    """Args:
        devices: NVML device indices (default: ``CUDA_VISIBLE_DEVICES``, else device 0).
    """
    source = "nvml"

    def __init__(self, devices: list[int] | None = None):
        self._fallback: CPUReader | None = None
        self._handles = []
        try:
            import pynvml
            pynvml.nvmlInit()
            if devices is None:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
                devices = [int(d) for d in visible.split(",") if d.strip().isdigit()] or [0]
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in devices]
            self._nvml = pynvml
        except Exception as e:  # NVMLError (no driver, no device) or a missing library
            self._fall_back(e)

    def _fall_back(self, error: Exception) -> None:
        if self._fallback is None:
            log.warning("NVML unavailable (%s: %s); reading KV accounting and process memory instead",
                        type(error).__name__, error)
            self._fallback = CPUReader()

    @property
    def active_source(self) -> str:
        return "cpu" if self._fallback is not None else "nvml"

    def read(self, stats: dict) -> MemoryReading:
        if self._fallback is None:
            try:
                used = total = 0
                for h in self._handles:
                    info = self._nvml.nvmlDeviceGetMemoryInfo(h)
                    used, total = used + int(info.used), total + int(info.total)
                return MemoryReading(used, total, "nvml")
            except Exception as e:  # a lost GPU mid-run
                self._fall_back(e)
        return self._fallback.read(stats)


class ScriptedReader:
    """Replays ``fractions`` (memory used / total) one per read, then holds the last one."""
    source = "scripted"

    def __init__(self, fractions: list[float], total_bytes: int = 1 << 30):
        if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
            raise ValueError(f"scripted fractions must be a non-empty list in [0, 1], got {fractions}")
        self.fractions, self.total, self.i = list(fractions), total_bytes, 0

    def read(self, stats: dict) -> MemoryReading:
        f = self.fractions[min(self.i, len(self.fractions) - 1)]
        self.i += 1
        return MemoryReading(int(f * self.total), self.total, "scripted")


def make_reader(spec: str):
    """A reader from its config string: ``auto`` (NVML with CPU fallback), ``nvml``, ``cpu`` or
    ``scripted:[0.5, 0.9, ...]`` (a JSON list of fractions).

    Raises:
        ValueError: an unknown spec or a bad script.
    """
    if spec in ("auto", "nvml"):
        return NVMLReader()
    if spec == "cpu":
        return CPUReader()
    if spec.startswith("scripted:"):
        try:
            return ScriptedReader(json.loads(spec[len("scripted:"):]))
        except json.JSONDecodeError as e:
            raise ValueError(f"memory reader {spec!r}: the script is not a JSON list ({e})") from None
    raise ValueError(f"unknown memory reader {spec!r}; use auto, nvml, cpu or scripted:[...]")
