"""YAML text reaches the config only through a file: these helpers write one."""

from __future__ import annotations

import tempfile
from pathlib import Path

from dispatcher import config as cfg


def load_text(text: str | bytes) -> cfg.Loaded:
    """What :func:`dispatcher.config.load` gives for a file holding ``text``."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "iop.yaml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return cfg.load(path)
