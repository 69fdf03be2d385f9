"""Offline calibration of the KV policies' frozen tables (PASK, CompilerKV).

    python -m calibration pask --model PATH --out DIR

Tables calibrated for the embedded model ship in ``calibration/tables/<kind>-<model name>``.
"""

from __future__ import annotations

from pathlib import Path

TABLES_DIR = Path(__file__).resolve().parent / "tables"


def shipped_table(kind: str, model_dir: str | Path) -> Path:
    """Folder of the table of ``kind`` shipped for the checkpoint at ``model_dir`` (which may not
    exist: loading it then fails with the command that builds one)."""
    return TABLES_DIR / f"{kind}-{Path(model_dir).resolve().name}"
