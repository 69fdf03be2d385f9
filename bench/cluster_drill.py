"""Cluster-control drill on a real Ray cluster: table versions under traffic, and autoscaling.

    python -m bench.cluster_drill [--phase tables|autoscale|both] [--out docs/results/cluster_drill.md]

Needs ``ray start --head`` to be possible here (it starts and stops its own cluster).

Phase ``tables``: deploys two replicas (PASK, budget controller on, CPU memory reader) and keeps
chat requests with tools flowing; submits a quick PASK calibration with ``ray job submit ...
--publish``; waits until the controller reports both replicas on the new version; publishes a
table calibrated for another model and checks that both replicas refuse it and keep serving.
Counts every request's HTTP status.

Phase ``autoscale``: redeploys with ``autoscaling_config`` (1..2 replicas, the KV-pressure policy)
and a small KV pool, drives concurrent load until Serve runs 2 replicas, stops it, and waits for 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORT = 8456
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def sh(cmd: list[str], check=True, timeout=900, env=None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or os.environ.copy())
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr


class Load:
    """``clients`` threads posting chat completions until stopped; counts status codes."""

    def __init__(self, clients: int, max_tokens: int = 24):
        self.codes: dict[int, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i, max_tokens), daemon=True) for i in range(clients)]

    def _run(self, i: int, max_tokens: int) -> None:
        import httpx
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    r = client.post(f"http://127.0.0.1:{PORT}/v1/chat/completions", json={
                        "model": "qwen3-fc-6m", "max_tokens": max_tokens, "tools": [TOOL],
                        "messages": [{"role": "user", "content": f"Weather in city number {i}-{n}?"}]})
                    code = r.status_code
                except Exception as e:  # connection refused / reset: a failed request
                    code = -1
                    with self._lock:
                        self.errors.append(f"{type(e).__name__}: {e}")
                with self._lock:
                    self.codes[code] = self.codes.get(code, 0) + 1

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def stop(self):
        self._stop.set()
        for t in self.threads:
            t.join(timeout=150)


def deploy(args: dict, name: str = "structkv") -> None:
    cfg = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": PORT},
           "applications": [{"name": name, "route_prefix": "/", "import_path": "cluster.app:build_app",
                             "args": args}]}   # the project is installed (pip install -e .) on this node
    f = Path(tempfile.mkdtemp()) / "drill.yaml"
    f.write_text(json.dumps(cfg))
    sh(["serve", "deploy", str(f)])
    wait(lambda: _healthy(), 300, "the application to become healthy")


def _healthy() -> bool:
    import httpx
    try:
        return httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=5).status_code == 200
    except Exception:
        return False


def wait(cond, timeout: float, what: str, period: float = 1.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(period)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def controller_status() -> dict:
    import ray

    from cluster.control import CONTROLLER_NAME, NAMESPACE
    return ray.get(ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE).status.remote())


def num_replicas() -> int:
    out = subprocess.run(["serve", "status"], capture_output=True, text=True, timeout=60).stdout  # YAML on stdout
    import yaml
    try:
        st = yaml.safe_load(out)
        dep = st["applications"]["structkv"]["deployments"]["LLMServer"]
        return int(dep["replica_states"].get("RUNNING", 0))
    except Exception:
        return -1


def bfcl_dir() -> Path:
    from models import bfcl
    return bfcl.bfcl_dir().resolve()


def phase_tables(log) -> None:
    import ray

    from calibration.artifacts import TableArtifact, load_artifact
    from cluster.control import get_registry
    deploy({"model": "models/qwen3-fc-6m", "kv_policy": "pask", "kv_budget": 0.5, "num_replicas": 2,
            "num_cpus": 0.5, "budget_controller": True, "memory_reader": "cpu", "control_period_s": 0.5,
            "kv_cache_bytes": 64 << 20})
    wait(lambda: len(controller_status()["replicas"]) == 2, 120, "both replicas to report")
    log(f"deployed 2 replicas: {sorted(controller_status()['replicas'])}")
    load = Load(clients=3).start()
    t0 = time.time()
    out = sh(["ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", str(REPO),
              "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "docs"],
                                                "env_vars": {"BFCL_DIR": str(bfcl_dir())}}), "--",
              "python", "-m", "calibration", "pask", "--model", "models/qwen3-fc-6m", "--out", "/tmp/drill-pask",
              "--executor", "ray", "--workers", "1", "--per-category", "1", "--categories", "simple,irrelevance",
              "--max-new-tokens", "24", "--distortion-examples", "1", "--no-progress", "--publish",
              "--version", "drill-1"], timeout=1800)
    said = [l for l in out.splitlines() if l.startswith(("wrote ", "published "))]
    log(f"calibration job (ray job submit) finished in {time.time() - t0:.0f} s under traffic: {said}")
    t1 = time.time()
    wait(lambda: all(r["table_version"] == "drill-1" for r in controller_status()["replicas"].values()),
         60, "both replicas to switch to drill-1", 0.5)
    log(f"both replicas serve table drill-1 (checked {time.time() - t1:.1f} s after the job ended)")
    bad = Path(tempfile.mkdtemp()) / "other-model"
    art = load_artifact("/tmp/drill-pask", "pask")
    TableArtifact("pask", art.tables, "0" * 64, art.meta).save(bad)
    sh(["python", "-m", "calibration", "publish", "--kind", "pask", "--artifact", str(bad), "--version", "drill-bad"])
    time.sleep(5)
    versions = {k: r["table_version"] for k, r in controller_status()["replicas"].items()}
    refusals = ray.get(get_registry().get_refusals.remote())
    log(f"after publishing a table for another model: replicas serve {versions}; refusals: "
        f"{[(r['replica'][:8], r['version'], r['error'].split(': ', 2)[-1][:90]) for r in refusals]}")
    time.sleep(5)
    load.stop()
    log(f"requests during the drill: {load.codes} (status -> count); transport errors: {load.errors[:3]}")
    if set(load.codes) - {200} or set(versions.values()) != {"drill-1"} or len(refusals) < 2:
        raise SystemExit("tables drill FAILED")


def phase_autoscale(log) -> None:
    deploy({"model": "models/qwen3-fc-6m", "kv_policy": "pask", "kv_budget": 1.0, "num_cpus": 0.5,
            "budget_controller": True, "memory_reader": "cpu", "control_period_s": 0.5,
            "high_water": 0.6, "low_water": 0.3, "kv_cache_bytes": 2 << 20, "max_num_seqs": 32,
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1,
                                   "metrics_interval_s": 0.5, "look_back_period_s": 2,
                                   "upscale_delay_s": 1, "downscale_delay_s": 3}})
    log(f"autoscaling deployment up with {num_replicas()} replica(s)")
    load = Load(clients=12, max_tokens=128).start()
    t0 = time.time()
    try:
        wait(lambda: num_replicas() >= 2, 300, "scale-out to 2 replicas", 2)
        log(f"scaled out to 2 replicas {time.time() - t0:.0f} s into the load; controller: "
            f"{ {k[:8]: round(r['budget'], 2) for k, r in controller_status()['replicas'].items()} }")
    finally:
        load.stop()
    t1 = time.time()
    wait(lambda: num_replicas() == 1, 300, "scale-in to 1 replica", 2)
    log(f"scaled in to 1 replica {time.time() - t1:.0f} s after the load stopped; requests {load.codes}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_drill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("tables", "autoscale", "both"), default="both")
    ap.add_argument("--out", type=Path, default=REPO / "docs/results/cluster_drill.md")
    args = ap.parse_args(argv)
    lines = []

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        lines.append(line)

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    # A throwaway loopback cluster: without this, CLI calls after `ray start` need its auth token.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sh(["ray", "start", "--head", "--num-cpus", "4", "--disable-usage-stats", "--include-dashboard", "true"])
    try:
        import ray
        ray.init(address="auto", namespace="structkv", log_to_driver=False)
        if args.phase in ("tables", "both"):
            phase_tables(log)
        if args.phase in ("autoscale", "both"):
            phase_autoscale(log)
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("# Cluster-control drill (`python -m bench.cluster_drill`)\n\n```\n" + "\n".join(lines) + "\n```\n")
        sh(["serve", "shutdown", "-y"], check=False)
        import ray
        ray.shutdown()   # before `ray stop`: a driver connected to a stopped cluster is killed outright
        sh(["ray", "stop", "--force"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
