"""Frozen calibration tables: save, load and validate (PASK tables, CompilerKV tables).

An artifact is a folder with ``manifest.json`` and one ``tables.safetensors``: the manifest names
the kind and version, the model fingerprint, the data and settings that produced it, the measured
results, and a SHA-256 content hash over the tables and every other manifest field. Loading
recomputes the hash and the fingerprint of the model the replica serves, and refuses a mismatch
with an error that says what differs and which command rebuilds the artifact.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


class ArtifactError(ValueError):
    """An artifact that is missing, corrupted, or made for another model."""


def model_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 over a checkpoint's config.json and its safetensors headers (tensor names, dtypes,
    shapes, offsets) and file sizes: cheap even for large models, and changes with the weights'
    layout or any re-save of the weights."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("transformers_version", None)
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()


def _tables_digest(tables: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tables):
        t = tables[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@dataclass
class TableArtifact:
    """Tables plus what produced them.

    Attributes:
        kind: "pask" or "compilerkv".
        tables: name -> tensor.
        model_fingerprint: :func:`model_fingerprint` of the calibrated model.
        meta: JSON-serializable facts: data, settings, measured budget and accuracy, bucket and
            layer-group definitions, the command that built it (``build_command``).
        version: increasing version of this kind of table.
    """
    kind: str
    tables: dict[str, torch.Tensor]
    model_fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    def content_hash(self) -> str:
        head = json.dumps({"kind": self.kind, "version": self.version, "format": FORMAT_VERSION,
                           "model_fingerprint": self.model_fingerprint, "meta": self.meta}, sort_keys=True)
        return hashlib.sha256((head + _tables_digest(self.tables)).encode()).hexdigest()

    def save(self, folder: str | Path) -> Path:
        from safetensors.torch import save_file
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tables.items()}, folder / "tables.safetensors")
        manifest = {"kind": self.kind, "version": self.version, "format": FORMAT_VERSION,
                    "model_fingerprint": self.model_fingerprint, "meta": self.meta,
                    "content_hash": self.content_hash()}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        return folder


def build_command(kind: str, cfg, model_dir, out, fields: tuple[str, ...], list_sep: dict[str, str] | None = None) -> str:
    """The CLI command that rebuilds a table: ``python -m calibration KIND --model M --out O`` plus one flag
    per field of the config dataclass ``cfg`` (among ``fields``, its CLI settings) that differs from the
    dataclass default. Tuples are joined with ``list_sep[field]`` (default a space)."""
    default = type(cfg)(cfg.model)
    flags = []
    for name in fields:
        value = getattr(cfg, name)
        if value != getattr(default, name):
            shown = (list_sep or {}).get(name, " ").join(map(str, value)) if isinstance(value, (tuple, list)) else value
            flags.append(f" --{name.replace('_', '-')} {shown}")
    return f"python -m calibration {kind} --model {model_dir} --out {out}" + "".join(flags)


def load_artifact(folder: str | Path, kind: str, model_dir: str | Path | None = None) -> TableArtifact:
    """Load and validate an artifact.

    Args:
        folder: the artifact folder.
        kind: the expected kind.
        model_dir: the served checkpoint; when given, its fingerprint must match.

    Raises:
        ArtifactError: missing files (the message names the build command when the manifest has
            it), another kind or format, a content hash that does not match (corrupted or edited),
            or a model fingerprint that does not match the served model.
    """
    from safetensors.torch import load_file
    folder = Path(folder)
    manifest_path, tables_path = folder / "manifest.json", folder / "tables.safetensors"
    if not manifest_path.is_file() or not tables_path.is_file():
        raise ArtifactError(f"no {kind} table artifact at {folder} (build it with `python -m calibration {kind} "
                            f"--model PATH --out {folder}`)")
    try:
        manifest = json.loads(manifest_path.read_text())
        tables = load_file(tables_path)
    except Exception as e:
        raise ArtifactError(f"{folder}: unreadable artifact ({type(e).__name__}: {e})") from None
    if manifest.get("kind") != kind or manifest.get("format") != FORMAT_VERSION:
        raise ArtifactError(f"{folder}: a {manifest.get('kind')!r} artifact of format {manifest.get('format')}, "
                            f"expected {kind!r} format {FORMAT_VERSION}")
    art = TableArtifact(kind, tables, manifest["model_fingerprint"], manifest.get("meta", {}), manifest.get("version", 1))
    if art.content_hash() != manifest.get("content_hash"):
        raise ArtifactError(f"{folder}: content hash mismatch (the tables or manifest were changed after "
                            f"calibration); rebuild with `{art.meta.get('build_command', f'python -m calibration {kind}')}`")
    if model_dir is not None:
        served = model_fingerprint(model_dir)
        if served != art.model_fingerprint:
            raise ArtifactError(f"{folder}: calibrated for model {art.model_fingerprint[:12]}, but the served model "
                                f"{model_dir} is {served[:12]}; rebuild with "
                                f"`{art.meta.get('build_command', f'python -m calibration {kind}')}`")
    return art
