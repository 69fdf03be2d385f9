"""Ray Serve application builder (``import_path: cluster.app:build_app`` in serve_config.yaml)."""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any]):
    """Build the OpenAI-compatible Serve application from the config's ``args``.

    Raises:
        NotImplementedError: always, for now: the HTTP serving layer is the subject of a later
            issue (the engine and the API are not built yet).
    """
    raise NotImplementedError(
        "structkv: the serving application is not implemented yet; this checkout provides the "
        "embedded model, the synthetic BFCL task and `python -m bench.accuracy`.")
