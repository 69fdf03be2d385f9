"""The replica side of cluster control: report memory, apply budgets, follow table versions.

One :class:`ReplicaAgent` thread runs in each replica. Every period it reads the replica's memory
(``cluster.memory``), reports it to the budget controller, applies the budget it gets back between
engine steps (``LLMEngine.set_replica_budget``), and checks the table registry: a new version is
validated and swapped in (``LLMEngine.load_table``); a table that fails validation is reported to
the registry and skipped, and the replica keeps serving on its last good table. Each period also
sets the replica's Ray metrics (budget, memory reading, table version).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict

log = logging.getLogger(__name__)


class ReplicaAgent:
    """Args:
        replica_id: a name unique in the cluster.
        engine: an ``AsyncLLMEngine`` (anything with ``call(fn)`` running fn(engine) between steps).
        reader: a memory reader (``cluster.memory``).
        controller / registry: actor handles (``cluster.control``); registry may be None.
        table_kind: the policy's table kind ("pask"), or None to not follow tables.
        period_s: seconds between reports.
    """

    def __init__(self, replica_id: str, engine, reader, controller, registry=None, table_kind: str | None = None,
                 period_s: float = 1.0):
        self.replica_id, self.engine, self.reader = replica_id, engine, reader
        self.controller, self.registry, self.kind, self.period_s = controller, registry, table_kind, period_s
        self.refused: set[str] = set()
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"agent-{replica_id}", daemon=True)
        self._metrics = None

    def start(self) -> "ReplicaAgent":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _gauges(self):
        if self._metrics is None:
            try:
                from ray.util import metrics
                tags = ("replica",)
                self._metrics = {
                    "budget": metrics.Gauge("structkv_replica_kv_budget", "Replica KV budget", tag_keys=tags),
                    "memory": metrics.Gauge("structkv_replica_memory_fraction", "Memory used / total",
                                            tag_keys=("replica", "source")),
                    "kv_bytes": metrics.Gauge("structkv_replica_kv_bytes", "KV bytes held", tag_keys=tags),
                    "table": metrics.Gauge("structkv_replica_table_version", "Index of the table version in use",
                                           tag_keys=("replica", "kind", "version"))}
            except Exception:
                self._metrics = {}
        return self._metrics

    def tick(self) -> dict:
        """One period: report, apply the budget, follow the registry. Returns what it saw."""
        import ray
        stats = self.engine.call(lambda e: e.stats())
        reading = self.reader.read(stats)
        serving = self.engine.call(lambda e: e.table_versions.get(self.kind)) if self.kind else None
        budget = ray.get(self.controller.report.remote(self.replica_id, asdict(reading), stats["floor"], serving),
                         timeout=30)
        if budget != stats["budget"]:
            self.engine.call(lambda e: e.set_replica_budget(budget))
        version = None
        if self.registry is not None and self.kind:
            current = ray.get(self.registry.current.remote(self.kind), timeout=30)
            loaded = self.engine.call(lambda e: e.table_versions.get(self.kind))
            version = loaded
            if current and current["version"] != loaded and current["version"] not in self.refused:
                try:
                    self.engine.call(lambda e: e.load_table(self.kind, current["path"], current["version"]))
                    version = current["version"]
                    log.info("replica %s: %s table %s loaded", self.replica_id, self.kind, version)
                except Exception as e:  # ArtifactError, ValueError: refuse, keep the last good table
                    self.refused.add(current["version"])
                    msg = f"{type(e).__name__}: {e}"
                    log.warning("replica %s refused %s table %s: %s", self.replica_id, self.kind, current["version"], msg)
                    self.registry.report_refused.remote(self.kind, current["version"], self.replica_id, msg)
        g = self._gauges()
        if g:
            g["budget"].set(budget, tags={"replica": self.replica_id})
            g["memory"].set(reading.fraction, tags={"replica": self.replica_id, "source": reading.source})
            g["kv_bytes"].set(stats["kv_bytes_used"], tags={"replica": self.replica_id})
            if version:
                g["table"].set(1, tags={"replica": self.replica_id, "kind": self.kind, "version": version})
        self.last = {**stats, "budget": budget, "reading": asdict(reading), "table_version": version}
        return self.last

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception as e:  # the controller restarting, a timeout: try again next period
                log.warning("replica %s: control tick failed: %s: %s", self.replica_id, type(e).__name__, e)
