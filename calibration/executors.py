"""Where calibration probes run: in this process, or as Ray actors (one probe per task).

A probe is a JSON-serializable dict handled by ``ProbeWorker.run``; its result is a JSON-serializable
dict. :class:`ProbeCache` makes a run resumable: every finished probe is appended to a JSONL file
keyed by the probe's content hash, and a rerun skips the probes already there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from tqdm import tqdm


def probe_key(task: dict) -> str:
    return hashlib.sha256(json.dumps(task, sort_keys=True).encode()).hexdigest()[:24]


class ProbeCache:
    """Append-only JSONL of finished probes (``{"key", "task_kind", "result"}`` per line)."""

    def __init__(self, path: Path | None):
        self.path, self.results = path, {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill: that probe reruns
                self.results[rec["key"]] = rec["result"]

    def get(self, key: str) -> dict | None:
        return self.results.get(key)

    def put(self, key: str, kind: str, result: dict) -> None:
        self.results[key] = result
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"key": key, "task_kind": kind, "result": result}) + "\n")


def open_run(out: Path, settings: dict) -> ProbeCache:
    """The probe cache of a run folder; a folder holding a run with other settings is refused.

    Raises:
        ValueError: ``out/settings.json`` records different settings.
    """
    out.mkdir(parents=True, exist_ok=True)
    file = out / "settings.json"
    settings = json.loads(json.dumps(settings))
    if file.is_file() and json.loads(file.read_text()) != settings:
        raise ValueError(f"{out} holds a calibration run with other settings ({file}); "
                         f"use a new --out folder or the same settings to resume")
    file.write_text(json.dumps(settings, indent=1) + "\n")
    return ProbeCache(out / "probes.jsonl")


def make_executor(kind: str, worker_cls, args: tuple, workers: int = 2, address: str | None = None,
                  num_gpus: float = 0):
    """A "ray" executor (``workers`` actors of ``worker_cls(*args)``, each reserving ``num_gpus``
    GPUs: with 0, Ray hides the GPUs from the actor and the engine runs on its CPU) or a "local" one."""
    if kind == "ray":
        return RayExecutor(worker_cls, args, num_workers=workers, num_gpus=num_gpus, address=address)
    return LocalExecutor(lambda: worker_cls(*args))


class LocalExecutor:
    """Runs probes one after another in this process (tests, single-core machines)."""

    def __init__(self, make_worker: Callable[[], Any]):
        self._make, self._worker = make_worker, None

    @property
    def width(self) -> int:
        return 1

    def map(self, tasks: list[dict]) -> Iterator[tuple[int, dict]]:
        if self._worker is None:
            self._worker = self._make()
        for i, task in enumerate(tasks):
            yield i, self._worker.run(task)

    def close(self) -> None:
        self._worker = None


class RayExecutor:
    """Runs probes on a pool of Ray actors, each holding one ``worker_cls(*args)``.

    Args:
        worker_cls: the worker class (built inside each actor).
        args: its constructor arguments.
        num_workers: actors in the pool.
        num_cpus: CPUs each actor reserves; ``num_gpus`` likewise.
        address: Ray cluster address (None: connect to a running one, else start a local one).
    """

    def __init__(self, worker_cls, args: tuple, num_workers: int = 2, num_cpus: float = 1,
                 num_gpus: float = 0, address: str | None = None):
        import os

        import ray
        if not ray.is_initialized():
            if address or os.environ.get("RAY_ADDRESS"):   # a cluster (e.g. under `ray job submit`)
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address="local", num_cpus=max(1, int(num_workers * num_cpus)), include_dashboard=False, log_to_driver=False)
        actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(worker_cls)
        self._ray = ray
        self._actors = [actor.remote(*args) for _ in range(num_workers)]

    @property
    def width(self) -> int:
        return len(self._actors)

    def map(self, tasks: list[dict]) -> Iterator[tuple[int, dict]]:
        ray, pending, queue = self._ray, {}, list(enumerate(tasks))
        idle = list(self._actors)
        while queue or pending:
            while queue and idle:
                i, task = queue.pop(0)
                actor = idle.pop()
                pending[actor.run.remote(task)] = (i, actor)
            done, _ = ray.wait(list(pending), num_returns=1)
            i, actor = pending.pop(done[0])
            idle.append(actor)
            yield i, ray.get(done[0])

    def close(self) -> None:
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []


def run_probes(executor, cache: ProbeCache, tasks: Iterable[dict], desc: str,
               progress: bool = True) -> list[dict]:
    """Results of ``tasks`` in order: cached ones read back, the others run and cached."""
    tasks = list(tasks)
    keys = [probe_key(t) for t in tasks]
    results: list[dict | None] = [cache.get(k) for k in keys]
    todo = [i for i, r in enumerate(results) if r is None]
    with tqdm(total=len(tasks), initial=len(tasks) - len(todo), desc=desc, disable=not progress,
              dynamic_ncols=True) as bar:
        for j, result in executor.map([tasks[i] for i in todo]):
            i = todo[j]
            results[i] = result
            cache.put(keys[i], tasks[i]["kind"], result)
            bar.update(1)
    return results  # type: ignore[return-value]
