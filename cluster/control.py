"""Cluster control actors: the KV budget controller and the table registry (design section 7).

Both are named, detached Ray actors in namespace ``structkv``, created by the application (or by
the first caller) with :func:`get_controller` / :func:`get_registry`.

- :class:`BudgetController`: each replica's agent (``cluster.agent``) reports a memory reading
  every period; the controller runs :func:`autoscale.budget.decide_budget` for that replica and
  answers its new KV budget. It keeps the last readings and decisions for the dashboard metrics
  and for :meth:`BudgetController.status`.
- :class:`TableRegistry`: versions of the frozen calibration tables. A calibration job copies its
  artifact into the table store (a directory every node can read) and publishes it; replicas poll
  :meth:`TableRegistry.current`, validate the artifact, and swap it in between engine steps. An
  invalid table is reported back (:meth:`TableRegistry.report_refused`) and the replica keeps its
  last good one. :meth:`TableRegistry.rollback` makes an earlier version current again. The
  registry's state is saved in ``<store>/registry.json``, so a restarted registry recovers it.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from autoscale.budget import BudgetSettings, MemoryReading, ReplicaBudgetState, decide_budget

NAMESPACE = "structkv"
CONTROLLER_NAME = "structkv-budget-controller"
REGISTRY_NAME = "structkv-table-registry"
DEFAULT_STORE = Path.home() / ".cache" / "structkv" / "table-store"


class BudgetController:
    """Args:
        settings: :class:`autoscale.budget.BudgetSettings` fields.
    """

    def __init__(self, settings: dict | None = None):
        self.settings = BudgetSettings(**(settings or {}))
        self.replicas: dict[str, dict] = {}
        self.decisions: list[dict] = []
        self._metrics = None

    def _gauges(self):
        if self._metrics is None:
            try:
                from ray.util import metrics
                self._metrics = (
                    metrics.Gauge("structkv_controller_budget", "KV budget the controller set per replica",
                                  tag_keys=("replica",)),
                    metrics.Gauge("structkv_controller_memory_fraction", "Memory reading per replica",
                                  tag_keys=("replica", "source")),
                    metrics.Counter("structkv_controller_budget_changes", "Budget changes by direction",
                                    tag_keys=("direction",)))
            except Exception:  # outside a Ray worker: no metrics
                self._metrics = ()
        return self._metrics

    def configure(self, settings: dict) -> None:
        """Replace the decision settings (a redeployed application with other water marks)."""
        self.settings = BudgetSettings(**settings)

    def report(self, replica_id: str, reading: dict, floor: float, table_version: str | None = None) -> float:
        """Record a replica's reading (and the table version it serves), decide, and return its
        budget (in ``[floor, 1]``)."""
        r = MemoryReading(**reading)
        entry = self.replicas.setdefault(replica_id, {"state": ReplicaBudgetState()})
        old = entry["state"]
        new = decide_budget(old, r, floor, self.settings)
        entry.update(state=new, reading=reading, floor=floor, seen=time.time(), table_version=table_version)
        if new.budget != old.budget:
            direction = "down" if new.budget < old.budget else "up"
            self.decisions.append({"t": time.time(), "replica": replica_id, "from": old.budget,
                                   "to": new.budget, "fraction": r.fraction, "source": r.source})
            del self.decisions[:-1000]
            if self._gauges():
                self._gauges()[2].inc(tags={"direction": direction})
        if self._gauges():
            self._gauges()[0].set(new.budget, tags={"replica": replica_id})
            self._gauges()[1].set(r.fraction, tags={"replica": replica_id, "source": r.source})
        return new.budget

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def status(self) -> dict:
        return {"settings": asdict(self.settings),
                "replicas": {k: {"budget": v["state"].budget, "floor": v.get("floor"), "reading": v.get("reading"),
                                 "table_version": v.get("table_version"), "seen": v.get("seen")}
                             for k, v in self.replicas.items()},
                "decisions": list(self.decisions)}


class TableRegistry:
    """Args:
        store: the table store directory (shared by every node).
    """

    def __init__(self, store: str | None = None):
        self.store = Path(store or DEFAULT_STORE)
        self.store.mkdir(parents=True, exist_ok=True)
        self._file = self.store / "registry.json"
        state = json.loads(self._file.read_text()) if self._file.is_file() else {}
        self.versions: dict[str, list[dict]] = state.get("versions", {})
        self.current_version: dict[str, str] = state.get("current", {})
        self.refusals: list[dict] = []

    def _save(self) -> None:
        tmp = self._file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"versions": self.versions, "current": self.current_version}, indent=1))
        tmp.replace(self._file)

    def publish(self, kind: str, path: str, version: str | None = None) -> str:
        """Make the artifact at ``path`` (inside the store) the current ``kind`` table.

        Raises:
            ValueError: the version name is already taken, or ``path`` holds no manifest.
        """
        if not (Path(path) / "manifest.json").is_file():
            raise ValueError(f"{path} holds no table artifact (manifest.json)")
        entries = self.versions.setdefault(kind, [])
        version = version or f"v{len(entries) + 1}"
        if any(e["version"] == version for e in entries):
            raise ValueError(f"{kind} table version {version!r} already exists")
        entries.append({"version": version, "path": str(path), "published": time.time()})
        self.current_version[kind] = version
        self._save()
        return version

    def current(self, kind: str) -> dict | None:
        """``{"version", "path"}`` of the current table of ``kind``, or None."""
        v = self.current_version.get(kind)
        return next(({"version": e["version"], "path": e["path"]} for e in self.versions.get(kind, [])
                     if e["version"] == v), None)

    def rollback(self, kind: str, version: str) -> dict:
        """Make an earlier ``version`` current again.

        Raises:
            ValueError: no such version (the message lists the known ones).
        """
        known = [e["version"] for e in self.versions.get(kind, [])]
        if version not in known:
            raise ValueError(f"no {kind} table version {version!r}; known: {', '.join(known) or 'none'}")
        self.current_version[kind] = version
        self._save()
        return self.current(kind)

    def list_versions(self, kind: str) -> list[dict]:
        return [dict(e, current=e["version"] == self.current_version.get(kind)) for e in self.versions.get(kind, [])]

    def report_refused(self, kind: str, version: str, replica_id: str, error: str) -> None:
        self.refusals.append({"kind": kind, "version": version, "replica": replica_id, "error": error,
                              "t": time.time()})
        del self.refusals[:-1000]

    def get_refusals(self) -> list[dict]:
        return list(self.refusals)

    def store_dir(self) -> str:
        return str(self.store)


def _named(cls, name: str, *args):
    import ray
    return ray.remote(cls).options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                   num_cpus=0, max_restarts=-1).remote(*args)


def get_controller(settings: dict | None = None):
    """The cluster's budget controller actor (created on first use; ``settings`` also replace
    those of a running one)."""
    handle = _named(BudgetController, CONTROLLER_NAME, settings)
    if settings:
        handle.configure.remote(settings)
    return handle


def get_registry(store: str | None = None):
    """The cluster's table registry actor (created on first use)."""
    return _named(TableRegistry, REGISTRY_NAME, store)


def publish_artifact(artifact: str | Path, kind: str, store: str | Path | None = None,
                     version: str | None = None) -> str:
    """Copy a built artifact into the table store and publish it as the current ``kind`` table.

    Returns the version name. Raises ``calibration.artifacts.ArtifactError`` for an artifact that
    does not validate (checked before anything is copied) and ValueError from the registry.
    """
    import ray

    from calibration.artifacts import load_artifact
    load_artifact(artifact, kind)   # hash and shape of the manifest; the replicas check the model
    registry = get_registry(str(store) if store else None)
    store = Path(ray.get(registry.store_dir.remote()))
    stamp = version or time.strftime("%Y%m%d-%H%M%S")
    dest = store / kind / stamp
    if dest.exists():
        raise ValueError(f"{dest} already exists; choose another --version")
    shutil.copytree(artifact, dest)
    return ray.get(registry.publish.remote(kind, str(dest), version or stamp))
