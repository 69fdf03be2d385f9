"""Ray Serve application: ``import_path: cluster.app:build_app`` in serve_config.yaml.

Each replica hosts one engine (:class:`replicas.async_engine.AsyncLLMEngine`) and serves the
OpenAI-compatible API of :mod:`cluster.openai_api` on it.
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
    max_pending: int = Field(256, ge=1, description="In-flight requests per replica before 429.")
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1, gt=0, description="CPUs reserved per replica.")


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
@serve.ingress()
class OpenAIDeployment:
    def __init__(self, args: dict):
        from cluster.openai_api import OpenAIServer
        from replicas.async_engine import AsyncLLMEngine
        from replicas.config import EngineConfig
        a = AppArgs(**args)
        engine = AsyncLLMEngine.from_config(EngineConfig(
            model=a.model, kv_policy=a.kv_policy, kv_budget=a.kv_budget, kv_cache_bytes=a.kv_cache_bytes,
            max_num_seqs=a.max_num_seqs, tensor_parallel_size=a.tensor_parallel_size))
        self.server = OpenAIServer(engine, a.served_model_name or Path(a.model).name, a.max_pending)

    def __serve_build_asgi_app__(self):
        from cluster.openai_api import build_app as build_fastapi
        return build_fastapi(self.server)


def build_app(args: dict):
    """Validate the config's ``args`` and bind the deployment.

    Raises:
        pydantic.ValidationError: an unknown or out-of-range setting (named in the message).
        CheckpointNotFoundError: the model folder does not hold a checkpoint.
    """
    a = AppArgs(**(args or {}))
    from replicas.policies import POLICIES
    if a.kv_policy not in POLICIES:
        raise ValueError(f"unknown kv_policy {a.kv_policy!r}; choose from {', '.join(POLICIES)}")
    a.model = str(resolve_model(a.model))
    return OpenAIDeployment.options(num_replicas=a.num_replicas,
                                    ray_actor_options={"num_cpus": a.num_cpus}).bind(a.model_dump())
