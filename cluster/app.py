"""Ray Serve application: ``import_path: cluster.app:build_app`` in serve_config.yaml.

Two deployments, as Ray Serve LLM splits them: ``OpenAIIngress`` serves the HTTP API of
:mod:`cluster.openai_api` (auth, body limits, error envelope) and forwards each request through a
deployment handle to ``LLMServer``, whose replicas each host one engine
(:class:`replicas.async_engine.AsyncLLMEngine`) and turn requests into responses. A replica that dies
with requests in flight costs those requests a 503 with Retry-After (or a final SSE error event once
a stream has started), not a 500 from the proxy; a request that got nothing yet is retried once on
another replica.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

REPO_ROOT = Path(__file__).resolve().parents[1]


class AppArgs(BaseModel):
    """The ``args`` of the application in serve_config.yaml."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="HF checkpoint folder; default: the embedded model.")
    served_model_name: str | None = Field(None, description="Model id clients send (default: folder name).")
    tensor_parallel_size: int = Field(1, ge=1)
    kv_policy: str = Field("full", description="KV policy name (replicas.policies.POLICIES).")
    kv_budget: float = Field(1.0, gt=0.0, le=1.0, description="Default total KV budget per request.")
    kv_cache_bytes: int = Field(512 << 20, gt=0, description="KV pool per replica (per rank), bytes.")
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(8192, ge=1, description="Prompt tokens prefilled per engine step.")
    enable_chunked_prefill: bool = Field(False, description="Prefill prompts longer than max_num_batched_tokens "
                                         "over several steps, alternating with decode steps (running streams "
                                         "wait one chunk, not a whole prompt).")
    enable_prefix_caching: bool = Field(False, description="Share the KV pages of identical prompt prefixes "
                                        "(system prompt, tools) between requests; with pask the compressed prefix is shared too.")
    enable_jump_forward: bool = Field(False, description="Draft the tokens a grammar forces (tool-call scaffold, "
                                      "keys, the rest of an enum value) and keep those the model samples itself, "
                                      "without a decode step each: same outputs, fewer steps "
                                      "(EngineConfig.enable_jump_forward; docs/results/jump_forward.md).")
    max_pending: int = Field(256, ge=1, description="In-flight requests per replica before 429.")
    replica_retries: int = Field(1, ge=0, le=5, description="Times a request that received nothing yet is "
                                 "sent to another replica after its replica died.")
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1, gt=0, description="CPUs reserved per replica (per tensor-parallel rank).")
    num_gpus: float = Field(0, ge=0, description="GPUs per tensor-parallel rank (0: CPU engine).")
    kv_policy_args: dict = Field(default_factory=dict, description="Keyword arguments of the KV policy.")
    budget_controller: bool = Field(False, description="Report memory to the cluster budget controller and "
                                    "follow its KV budgets and the table registry (cluster/control.py).")
    memory_reader: str = Field("auto", description="auto (NVML, CPU fallback), nvml, cpu or scripted:[...].")
    control_period_s: float = Field(1.0, gt=0)
    high_water: float = Field(0.85, gt=0, le=1, description="Memory fraction above which budgets fall.")
    low_water: float = Field(0.65, gt=0, lt=1, description="Memory fraction under which budgets recover.")
    table_store: str | None = Field(None, description="Table store directory (default ~/.cache/structkv/table-store).")
    limits: dict = Field(default_factory=dict, description="Request limits checked before the engine "
                         "(cluster.protocol.Limits: max_body_bytes, max_stop, max_tools, max_schema_bytes, ...).")
    api_key: str | None = Field(None, description="Bearer token required on /v1 routes; default: "
                                "api_key_file, else the STRUCTKV_API_KEY environment variable, else no auth.")
    api_key_file: str | None = Field(None, description="File holding the API key (first line).")
    autoscaling_config: dict | None = Field(None, description="Ray Serve autoscaling_config (replaces "
                                            "num_replicas); the policy defaults to autoscale.policy:kv_pressure_policy.")


def resolve_model(model: str | None) -> Path:
    """A model folder given relative to the working directory or to the repository."""
    from models import resolve_checkpoint
    if model is None:
        return resolve_checkpoint()
    path = Path(model)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    return resolve_checkpoint(path.resolve())


@serve.deployment(health_check_period_s=10, health_check_timeout_s=60)
class LLMServer:
    """One engine replica: ``chat`` / ``completion`` stream a response (see
    :meth:`cluster.openai_api.OpenAIServer.chat`); ``check_health`` goes through the engine loop."""

    def __init__(self, args: dict):
        from cluster.openai_api import OpenAIServer
        from replicas.async_engine import AsyncLLMEngine
        from replicas.config import EngineConfig
        a = AppArgs(**args)
        engine = AsyncLLMEngine.from_config(EngineConfig(
            model=a.model, kv_policy=a.kv_policy, kv_budget=a.kv_budget, kv_cache_bytes=a.kv_cache_bytes,
            max_num_seqs=a.max_num_seqs, tensor_parallel_size=a.tensor_parallel_size,
            kv_policy_args=a.kv_policy_args, max_num_batched_tokens=a.max_num_batched_tokens,
            enable_chunked_prefill=a.enable_chunked_prefill, enable_prefix_caching=a.enable_prefix_caching,
            enable_jump_forward=a.enable_jump_forward))
        self.engine = engine
        from cluster.protocol import Limits
        self.server = OpenAIServer(engine, a.served_model_name or Path(a.model).name, a.max_pending,
                                   None, Limits(**a.limits))
        self.agent = None
        if a.budget_controller:
            from cluster.agent import ReplicaAgent
            from cluster.control import get_controller, get_registry
            from cluster.memory import make_reader
            replica_id = serve.get_replica_context().replica_id.unique_id
            controller = get_controller({"high_water": a.high_water, "low_water": a.low_water})
            kinds = engine.call(lambda e: getattr(e.policy, "table_kinds", ()))
            kind = kinds[0] if kinds else None
            self.agent = ReplicaAgent(replica_id, engine, make_reader(a.memory_reader), controller,
                                      get_registry(a.table_store) if kind else None, kind,
                                      a.control_period_s).start()

    async def chat(self, req):
        async for item in _errors_as_items(self.server.chat(req)):
            yield item

    async def completion(self, req):
        async for item in _errors_as_items(self.server.completion(req)):
            yield item

    async def health(self) -> None:
        await self.server.health()

    async def check_health(self) -> None:
        """Ray Serve's health check: fails when the engine loop is dead or stuck in a step for 30 s."""
        await self.engine.ping(30.0)

    def stats(self) -> dict:
        """The engine's counters (``LLMEngine.stats``) with this replica's id and process id."""
        import os
        return {"replica": serve.get_replica_context().replica_id.unique_id, "pid": os.getpid(),
                **self.engine.call(lambda e: e.stats())}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Per-replica metrics for ``autoscale.policy.kv_pressure_policy``."""
        s = self.engine.call(lambda e: e.stats())
        return {"kv_pressure": s["kv_bytes_used"] / s["kv_bytes_max"], "queue_len": float(s["num_waiting"]),
                "budget": s["budget"], "budget_at_floor": float(s["floor"] > 0 and s["budget"] <= s["floor"] + 1e-9)}

    def __del__(self):
        if getattr(self, "agent", None) is not None:
            self.agent.stop()


_API_ERROR = "__api_error__"


async def _errors_as_items(items):
    """A request error crosses to the ingress as an item, not as an exception: Ray Serve would log
    each 4xx as a failed call with its traceback."""
    from cluster.openai_api import APIError
    try:
        async for item in items:
            yield item
    except APIError as e:
        yield {_API_ERROR: [e.status, e.message, e.type, e.param, e.headers]}


class EngineClient:
    """The frontend of :func:`cluster.openai_api.build_app` in the ingress: forwards each request
    to an ``LLMServer`` replica through a deployment handle.

    A replica that dies (``RayActorError``, Serve's ``ReplicaUnavailableError``) before anything of
    the response came back: the request goes to another replica, at most ``retries`` times, then
    503 with Retry-After. After a stream has started: a final SSE error event (code 503).
    """

    RETRY_AFTER_S = 2

    def __init__(self, handle, model_name: str, limits, api_key: str | None, retries: int = 1):
        from cluster.openai_api import APIMetrics
        self.handle, self.model_name, self.limits, self.api_key = handle, model_name, limits, api_key
        self.retries, self.metrics = retries, APIMetrics(model_name)

    async def open(self, kind: str, req):
        import asyncio

        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import ReplicaUnavailableError

        from cluster.openai_api import APIError, error_event
        for attempt in range(self.retries + 1):
            gen = self.handle.options(stream=True, method_name=kind).remote(req)
            started = done = False
            try:
                async for item in gen:
                    if isinstance(item, dict) and _API_ERROR in item:
                        error = APIError(*item[_API_ERROR])
                        if not started:
                            raise error
                        yield error_event(error)
                        break
                    started = True
                    yield item
                done = True
                return
            except RayTaskError as e:  # raised in the replica: an APIError crosses whole
                done = True
                cause = getattr(e, "cause", None)
                if isinstance(cause, APIError) and not started:
                    raise cause from None
                if started:  # the stream is under way: end it with an error event
                    yield error_event(cause if isinstance(cause, APIError) else APIError(
                        500, f"internal error: {type(cause).__name__}", "internal_server_error"))
                    return
                raise
            except (RayActorError, ReplicaUnavailableError) as e:
                done = True
                lost = f"the replica serving this request failed ({type(e).__name__}); retry"
                if started:  # a stream was cut: end it with an error event the client can see
                    yield error_event(APIError(503, lost, "service_unavailable"))
                    return
                if attempt == self.retries:
                    raise APIError(503, lost, "service_unavailable",
                                   headers={"Retry-After": str(self.RETRY_AFTER_S)}) from None
                await asyncio.sleep(0.5 * (attempt + 1))
            finally:
                if not done:  # the client went away (or the consumer stopped): stop the replica's work
                    gen.cancel()

    async def health(self) -> None:
        import asyncio

        from cluster.openai_api import APIError
        try:
            await asyncio.wait_for(self.handle.health.remote(), 60)
        except APIError:
            raise
        except Exception as e:  # the handle's own failures: no live replica, a timeout
            raise APIError(503, f"no healthy engine replica: {type(e).__name__}: {e}", "service_unavailable",
                           headers={"Retry-After": "5"}) from None


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress:
    """The HTTP entry point: the OpenAI API, auth and limits; engine work goes to ``LLMServer``."""

    def __init__(self, args: dict, llm_server):
        from cluster.protocol import Limits
        a = AppArgs(**args)
        self.client = EngineClient(llm_server, a.served_model_name or Path(a.model).name, Limits(**a.limits),
                                   resolve_api_key(a), a.replica_retries)

    def __serve_build_asgi_app__(self):
        from cluster.openai_api import build_app as build_fastapi
        return build_fastapi(self.client)


def resolve_api_key(a: AppArgs) -> str | None:
    """The API key: ``api_key``, else the first line of ``api_key_file``, else ``STRUCTKV_API_KEY``.

    Raises:
        ValueError: ``api_key_file`` missing or empty (refusing to start open by mistake).
    """
    import os
    if a.api_key:
        return a.api_key
    if a.api_key_file:
        path = Path(a.api_key_file).expanduser()
        key = path.read_text().strip().splitlines()[0].strip() if path.is_file() and path.read_text().strip() else ""
        if not key:
            raise ValueError(f"api_key_file {path} is missing or empty")
        return key
    return os.environ.get("STRUCTKV_API_KEY") or None


def build_app(args: dict):
    """Validate the config's ``args`` and bind the deployment.

    Raises:
        pydantic.ValidationError: an unknown or out-of-range setting (named in the message).
        CheckpointNotFoundError: the model folder does not hold a checkpoint.
    """
    a = AppArgs(**(args or {}))
    from cluster.protocol import Limits
    Limits(**a.limits)  # an unknown or out-of-range limit fails here, before any replica starts
    resolve_api_key(a)
    if a.low_water >= a.high_water:
        raise ValueError(f"low_water ({a.low_water}) must be below high_water ({a.high_water})")
    from replicas.policies import POLICIES
    if a.kv_policy not in POLICIES:
        raise ValueError(f"unknown kv_policy {a.kv_policy!r}; choose from {', '.join(POLICIES)}")
    if a.enable_prefix_caching:   # refused here, before any replica starts
        from replicas.prefix_cache import check_policy
        check_policy(a.kv_policy, a.tensor_parallel_size)
    a.model = str(resolve_model(a.model))
    options = replica_options(a)
    if a.autoscaling_config is not None:
        options["autoscaling_config"] = {"policy": {"policy_function": "autoscale.policy:kv_pressure_policy"},
                                         **a.autoscaling_config}
    else:
        options["num_replicas"] = a.num_replicas
    options["max_ongoing_requests"] = a.max_pending
    return OpenAIIngress.bind(a.model_dump(), LLMServer.options(**options).bind(a.model_dump()))


def replica_options(a: AppArgs) -> dict:
    """Resources of one replica. With tensor parallelism, a placement group with one bundle per
    rank on one node (STRICT_PACK): the replica runs rank 0 in bundle 0 and starts ranks 1..N-1
    as Ray tasks in the others (``replicas.tp``), as Ray Serve LLM places vLLM's workers."""
    rank = {"CPU": a.num_cpus, **({"GPU": a.num_gpus} if a.num_gpus else {})}
    actor = {"num_cpus": a.num_cpus, **({"num_gpus": a.num_gpus} if a.num_gpus else {})}
    if a.tensor_parallel_size == 1:
        return {"ray_actor_options": actor}
    return {"ray_actor_options": actor, "placement_group_bundles": [dict(rank) for _ in range(a.tensor_parallel_size)],
            "placement_group_strategy": "STRICT_PACK"}
