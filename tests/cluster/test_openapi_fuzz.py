"""Schemathesis against the app's own OpenAPI schema, in-process: positive and negative cases for
every route; no 5xx, documented status codes and content types, bodies that match the documented
response schemas, and invalid requests refused with 4xx."""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from cluster.openai_api import OpenAIServer, build_app
from replicas.async_engine import AsyncLLMEngine

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                 not_a_server_error, response_schema_conformance, status_code_conformance)

MODEL = "qwen3-fc-6m"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def api_schema(engine):
    server = OpenAIServer(AsyncLLMEngine(engine), MODEL, max_pending=64)
    yield schemathesis.openapi.from_asgi("/openapi.json", build_app(server))
    server.engine.shutdown()


def _operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_openapi_schema_fuzz(api_schema, mode):
    ops = _operations(api_schema)
    assert {op.label for op in ops} >= {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
                                        "GET /health"}
    seen = []
    for op in ops:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict):
                if mode == GenerationMode.POSITIVE:  # the served model, so that valid bodies reach the engine
                    case.body["model"] = MODEL
                    if "max_completion_tokens" not in case.body:
                        case.body.setdefault("max_tokens", 4)
                for key in ("max_tokens", "max_completion_tokens"):  # short generations: the checks are
                    if type(case.body.get(key)) is int and case.body[key] >= 1:  # about the API, not the model
                        case.body[key] = min(case.body[key], 4)
            response = case.call_and_validate(checks=CHECKS, timeout=120)
            seen.append((op.label, response.status_code))
        try:
            run()
        except Unsatisfiable:  # no invalid input exists for a route without parameters or body
            assert mode == GenerationMode.NEGATIVE and op.method.upper() == "GET", op.label
    posts = [s for label, s in seen if label.startswith("POST")]
    assert len(posts) >= 20, seen
    if mode == GenerationMode.POSITIVE:  # valid bodies reach the engine and get answers
        assert posts.count(200) >= 5, sorted(posts)
    else:  # invalid bodies are refused with 4xx (negative_data_rejection checks each one)
        assert all(400 <= s < 500 for s in posts), sorted(posts)
