"""Baseline KV compression policies, one file each (kvpress style)."""

from replicas.policies.compilerkv import CompilerKVPolicy, CompilerKVTables
from replicas.policies.composed import CompilerKVPASKPolicy, PrefillDecodePolicy
from replicas.policies.h2o import H2OPolicy
from replicas.policies.pask import PASKPolicy, PASKTable
from replicas.policies.pyramidkv import PyramidKVPolicy
from replicas.policies.random import RandomPolicy
from replicas.policies.recency import RecencyPolicy
from replicas.policies.snapkv import SnapKVPolicy
from replicas.policies.streaming_llm import StreamingLLMPolicy

from replicas.policy import FullKV, KVPolicy

BASELINES = {p.name: p for p in (StreamingLLMPolicy, H2OPolicy, SnapKVPolicy, PyramidKVPolicy,
                                 RandomPolicy, RecencyPolicy)}
# PASK reads its calibrated table (policy argument ``table``: a folder; default: the one shipped
# for the served model).
POLICIES: dict[str, type[KVPolicy]] = {"full": FullKV, **BASELINES, "pask": PASKPolicy,
                                       "compilerkv": CompilerKVPolicy, "compilerkv+pask": CompilerKVPASKPolicy}


def make_policy(name: str, **kwargs) -> KVPolicy:
    """Instantiate a registered policy with its dataclass fields as keyword arguments.

    Raises:
        ValueError: an unknown policy name (the message lists the known ones) or a bad setting.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown KV policy {name!r}; choose from {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad settings for KV policy {name!r}: {e}") from None

__all__ = ["CompilerKVPASKPolicy", "CompilerKVPolicy", "CompilerKVTables", "BASELINES", "POLICIES", "make_policy", "H2OPolicy", "PrefillDecodePolicy", "PASKPolicy", "PASKTable", "PyramidKVPolicy", "RandomPolicy", "RecencyPolicy",
           "SnapKVPolicy", "StreamingLLMPolicy"]
