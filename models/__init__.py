"""The embedded default model, its synthetic task, tokenizer, chat format and BFCL checker."""

from pathlib import Path

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "qwen3-fc-6m"


class CheckpointNotFoundError(FileNotFoundError):
    """A model folder without config.json / model.safetensors."""


def resolve_checkpoint(path: str | Path | None = None) -> Path:
    """The checkpoint folder to load (the embedded model by default).

    Raises:
        CheckpointNotFoundError: the folder or its config.json / weights are missing; the message
            names the command that builds the embedded model.
    """
    folder = Path(path) if path else EMBEDDED_MODEL_DIR
    missing = [f for f in ("config.json", "model.safetensors") if not (folder / f).is_file()]
    if missing:
        raise CheckpointNotFoundError(
            f"model checkpoint not found: {folder} lacks {', '.join(missing)} "
            f"(the embedded model is built by `python -m models.train --out {EMBEDDED_MODEL_DIR}`)")
    return folder
