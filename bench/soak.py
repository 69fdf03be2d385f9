"""Soak: mixed traffic against the Serve application on loopback while engine replicas are killed.

    python -m bench.soak [--duration-s 600] [--kill-every-s 120] [--replicas 2] [--clients 6]
                         [--out docs/results/soak.md]

Starts a local Ray cluster and the application of ``serve_config.yaml`` (its args, with
``--replicas`` engine replicas) on 127.0.0.1, then runs ``--clients`` client threads for
``--duration-s`` seconds and stops by itself. Each client picks, at random with a fixed seed:

- ``tools``: a real BFCL question with its functions (``../shared/data/bfcl``), tool_choice auto;
- ``json_schema``: a JSONSchemaBench schema (Glaiveai2K) as response_format;
- ``stream``: the same, streamed (TTFT and inter-token latency are measured on these);
- ``cancel``: a stream the client hangs up on after three chunks;
- ``bad``: a schema with a dangling ``$ref`` (must get 400).

Every ``--kill-every-s`` seconds one engine replica process (``ServeReplica:<app>:LLMServer``)
chosen at random gets SIGKILL; Serve starts a replacement. Each request is counted as succeeded
(200, complete, tool arguments and finished JSON outputs valid against their schemas), failed by
design (the 400s asked for, schemas refused with 400, hang-ups, 429 / 503 with Retry-After, a stream
ended by an SSE error event with code 503) or failed otherwise (anything else: 5xx, a lost
connection, a stream cut without an error event, an output that breaks its schema). At the end,
after the replacements are up, the KV bytes each replica holds are read back against the baseline
read before the traffic.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
APP = "structkv"
DESIGN = ("400 asked for", "400 schema refused", "hung up", "429 retry-after", "503 retry-after",
          "stream error event 503")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Workload:
    """Request bodies from real data, drawn with a seeded generator."""

    def __init__(self, model: str):
        from models import bfcl
        self.model = model
        self.questions = []
        for cat in ("simple_python", "multiple"):
            for q in bfcl.load_questions(cat)[:100]:
                self.questions.append((q.messages, [bfcl.to_openai_tool(f, q.language) for f in q.functions]))
        with gzip.open(SHARED / "jsonschemabench" / "schemas" / "Glaiveai2K.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f][:200]
        self.schemas = [json.loads(r["json_schema"]) if isinstance(r.get("json_schema"), str) else r.get("json_schema", r)
                        for r in rows]

    def draw(self, rng: random.Random) -> tuple[str, dict, dict | None]:
        """(kind, body, schema to validate the output against)."""
        kind = rng.choices(["tools", "json_schema", "stream", "cancel", "bad"], [3, 2.5, 2.5, 1, 1])[0]
        base = {"model": self.model, "temperature": 0}
        if kind == "tools":
            messages, tools = rng.choice(self.questions)
            return kind, {**base, "messages": messages, "tools": tools, "tool_choice": "auto", "max_tokens": 128}, None
        if kind == "bad":
            schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
        else:
            schema = rng.choice(self.schemas)
        body = {**base, "messages": [{"role": "user", "content": "Fill in this form with plausible values."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}},
                "max_tokens": 96, "stream": kind in ("stream", "cancel")}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return kind, body, schema


class Soak:
    def __init__(self, url: str, workload: Workload, deadline: float):
        self.url, self.workload, self.deadline = url, workload, deadline
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.examples: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens_ok = 0
        self.lock = threading.Lock()

    def _record(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[kind][outcome] += 1
            if outcome.startswith("failed otherwise") and len(self.examples) < 20:
                self.examples.append(f"{time.strftime('%H:%M:%S')} {kind}: {outcome} {detail[:300]}")

    def client(self, seed: int) -> None:
        import httpx
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=180) as c:
            while time.time() < self.deadline:
                kind, body, schema = self.workload.draw(rng)
                try:
                    outcome, detail = self._one(c, kind, body, schema)
                except httpx.HTTPError as e:
                    outcome, detail = "failed otherwise: transport", f"{type(e).__name__}: {e}"
                self._record(kind, outcome, detail)

    def _status(self, kind: str, r) -> tuple[str, str]:
        """Outcome of a non-200 response."""
        try:
            err = r.json().get("error", {})
        except ValueError:
            err = {}
        if r.status_code == 400 and err:
            return ("400 asked for" if kind == "bad" else "400 schema refused"), err.get("message", "")
        if r.status_code in (429, 503) and err and r.headers.get("retry-after"):
            return f"{r.status_code} retry-after", err.get("message", "")
        return f"failed otherwise: HTTP {r.status_code}", r.text[:300]

    def _one(self, c, kind: str, body: dict, schema: dict | None) -> tuple[str, str]:
        import jsonschema
        if not body.get("stream"):
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                return self._status(kind, r)
            if kind == "bad":
                return "failed otherwise: bad request accepted", ""
            data = r.json()
            choice, n = data["choices"][0], data["usage"]["completion_tokens"]
            if kind == "tools":
                tools = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
                for call in choice["message"].get("tool_calls") or []:
                    fn = call["function"]
                    if fn["name"] not in tools:
                        return "failed otherwise: unknown function", fn["name"]
                    try:
                        jsonschema.validate(json.loads(fn["arguments"]), tools[fn["name"]])
                    except (ValueError, jsonschema.ValidationError) as e:
                        return "failed otherwise: arguments break the schema", str(e)[:200]
            elif choice["finish_reason"] == "stop":
                try:
                    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                except (ValueError, jsonschema.ValidationError) as e:
                    return "failed otherwise: output breaks the schema", str(e)[:200]
            with self.lock:
                self.tokens_ok += n
            return "succeeded", ""
        t0 = time.perf_counter()
        stamps, events, content = [], [], ""
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return self._status(kind, r)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line == "data: [DONE]":
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    break
                delta = (obj.get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    stamps.append(time.perf_counter())
                    content += delta["content"]
                    if kind == "cancel" and len(stamps) >= 3:
                        return "hung up", ""
        if not events:
            return "failed otherwise: empty stream", ""
        last = events[-1]
        if last != "[DONE]":
            err = json.loads(last).get("error") if last.startswith("{") else None
            if err and err.get("code") == 503:
                return "stream error event 503", err.get("message", "")
            return "failed otherwise: stream cut", last[:200]
        if kind == "cancel":
            return "failed otherwise: stream ended before the hang-up", ""
        usage, final = json.loads(events[-2]), json.loads(events[-3])   # usage chunk, finish chunk
        if final["choices"][0]["finish_reason"] == "stop":
            try:
                jsonschema.validate(json.loads(content), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                return "failed otherwise: output breaks the schema", str(e)[:200]
        with self.lock:
            if stamps:
                self.ttft.append(stamps[0] - t0)
            if len(stamps) > 1:
                self.itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
            self.tokens_ok += usage["usage"]["completion_tokens"]
        return "succeeded", ""


def replica_pids() -> list[int]:
    import psutil
    mark = f"ServeReplica:{APP}:LLMServer"
    return sorted(p.pid for p in psutil.process_iter(["cmdline"]) if any(mark in a for a in (p.info["cmdline"] or [])))


def replica_stats(n: int, timeout_s: float = 120) -> dict[str, dict]:
    from ray import serve
    handle = serve.get_deployment_handle("LLMServer", APP)
    seen: dict[str, dict] = {}
    deadline = time.time() + timeout_s
    while len(seen) < n and time.time() < deadline:
        try:
            s = handle.stats.remote().result(timeout_s=60)
            seen[s["replica"]] = s
        except Exception:  # noqa: BLE001 - a replica still starting
            time.sleep(0.5)
    return seen


def wait_running(n: int, timeout_s: float = 300) -> float:
    from ray import serve
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        states = serve.status().applications[APP].deployments["LLMServer"].replica_states
        if states.get("RUNNING", 0) >= n and len(replica_pids()) >= n:
            return time.time() - t0
        time.sleep(0.5)
    raise TimeoutError(f"{n} replicas not running after {timeout_s} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=600)
    ap.add_argument("--kill-every-s", type=float, default=120)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--port", type=int, default=8459)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=str(REPO / "serve_config.yaml"))
    ap.add_argument("--out", default=None, help="Markdown report (a .json beside it)")
    args = ap.parse_args(argv)

    import httpx
    import ray
    import yaml
    from ray import serve

    from cluster.app import build_app
    os.chdir(REPO)
    app_args = dict(yaml.safe_load(open(args.config))["applications"][0]["args"])
    app_args.update(num_replicas=args.replicas, num_cpus=1)
    ray.init(address="local", num_cpus=args.replicas + 1, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    t_start = time.time()
    serve.run(build_app(app_args), name=APP, route_prefix="/")
    print(f"app up with {args.replicas} replicas in {time.time() - t_start:.0f} s; args {app_args}", flush=True)
    url = f"http://127.0.0.1:{args.port}"
    baseline = {r: s["kv_bytes_used"] for r, s in replica_stats(args.replicas).items()}

    workload = Workload(Path(app_args.get("model") or "qwen3-fc-6m").name)
    t0 = time.time()
    soak = Soak(url, workload, t0 + args.duration_s)
    threads = [threading.Thread(target=soak.client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.clients)]
    for t in threads:
        t.start()
    kills, rng = [], random.Random(args.seed)
    next_kill, next_print = t0 + args.kill_every_s, t0 + 30
    while time.time() < soak.deadline:
        time.sleep(1)
        if time.time() >= next_kill and time.time() < soak.deadline - 5:
            pids = replica_pids()
            if pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                kills.append({"t_s": round(time.time() - t0, 1), "pid": victim, "replica_pids": pids})
                print(f"[{time.time() - t0:6.0f} s] killed replica pid {victim} of {pids}", flush=True)
            next_kill += args.kill_every_s
        if time.time() >= next_print:
            next_print += 30
            done = sum(sum(c.values()) for c in soak.outcomes.values())
            print(f"[{time.time() - t0:6.0f} s] {done} requests done", flush=True)
    for t in threads:
        t.join(timeout=300)
    elapsed = time.time() - t0

    recovered_s = wait_running(args.replicas)
    health = httpx.get(f"{url}/health", timeout=60).status_code
    end = {r: s["kv_bytes_used"] for r, s in replica_stats(args.replicas).items()}
    for _ in range(60):  # requests finishing their last step
        if all(v == 0 for v in end.values()):
            break
        time.sleep(1)
        end = {r: s["kv_bytes_used"] for r, s in replica_stats(args.replicas).items()}
    serve.shutdown()
    ray.shutdown()

    by_outcome = Counter()
    for c in soak.outcomes.values():
        by_outcome.update(c)
    sent = sum(by_outcome.values())
    ok = by_outcome["succeeded"]
    design = sum(v for k, v in by_outcome.items() if k in DESIGN)
    other = sum(v for k, v in by_outcome.items() if k.startswith("failed otherwise"))
    result = {
        "duration_s": round(elapsed, 1), "replicas": args.replicas, "clients": args.clients,
        "kill_every_s": args.kill_every_s, "kills": kills, "app_args": app_args,
        "sent": sent, "succeeded": ok, "failed_by_design": design, "failed_otherwise": other,
        "outcomes": {k: dict(v) for k, v in soak.outcomes.items()}, "failed_otherwise_examples": soak.examples,
        "goodput_req_s": round(ok / elapsed, 3), "goodput_tok_s": round(soak.tokens_ok / elapsed, 1),
        "ttft_s": {"p50": _pct(soak.ttft, 0.5), "p99": _pct(soak.ttft, 0.99), "n": len(soak.ttft)},
        "itl_s": {"p50": _pct(soak.itl, 0.5), "p99": _pct(soak.itl, 0.99), "n": len(soak.itl)},
        "replicas_running_again_after_s": round(recovered_s, 1), "health_at_end": health,
        "kv_bytes_baseline": baseline, "kv_bytes_end": end,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.write_text(_markdown(result, sys.argv[1:] if argv is None else argv))
        print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0 if other == 0 and all(v == 0 for v in end.values()) else 1


def _markdown(r: dict, argv) -> str:
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f} ms"  # noqa: E731
    kinds = sorted(r["outcomes"])
    outcomes = sorted({o for c in r["outcomes"].values() for o in c}, key=lambda o: (o != "succeeded", o))
    lines = [
        "# Soak: mixed traffic while engine replicas are killed (`python -m bench.soak`)", "",
        f"`python -m bench.soak {' '.join(argv or [])}`: the app of serve_config.yaml with {r['replicas']} engine "
        f"replicas on this 2-core CPU machine, {r['clients']} client threads on loopback for "
        f"{r['duration_s']:.0f} s, one replica SIGKILLed every {r['kill_every_s']:.0f} s "
        f"({len(r['kills'])} kills at {', '.join(str(k['t_s']) + ' s' for k in r['kills'])}).", "",
        f"- Requests sent: **{r['sent']}**; succeeded **{r['succeeded']}**; failed by design "
        f"**{r['failed_by_design']}**; failed otherwise **{r['failed_otherwise']}**.",
        f"- Goodput: {r['goodput_req_s']} requests/s, {r['goodput_tok_s']} completion tokens/s (succeeded requests only).",
        f"- Streams: TTFT p50 {ms(r['ttft_s']['p50'])}, p99 {ms(r['ttft_s']['p99'])} ({r['ttft_s']['n']} streams); "
        f"inter-token latency p50 {ms(r['itl_s']['p50'])}, p99 {ms(r['itl_s']['p99'])}.",
        f"- After the traffic: {r['replicas']} replicas running again within {r['replicas_running_again_after_s']} s, "
        f"/health {r['health_at_end']}; KV bytes held per replica {list(r['kv_bytes_end'].values())} "
        f"(baseline before the traffic {list(r['kv_bytes_baseline'].values())}).", "",
        "| outcome | " + " | ".join(kinds) + " | all |", "|---|" + "---:|" * (len(kinds) + 1)]
    for o in outcomes:
        row = [r["outcomes"][k].get(o, 0) for k in kinds]
        lines.append(f"| {o} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
    if r["failed_otherwise_examples"]:
        lines += ["", "Failed otherwise (first 20):", ""] + [f"- {e}" for e in r["failed_otherwise_examples"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
