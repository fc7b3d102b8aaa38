"""How iop's processes log: text lines (the default) or, with ``--log-format json``, one
JSON object per line -- ``time``, ``level``, ``role`` (api, worker), ``logger``, ``event``
(the message), and ``job``, ``model``, ``provider``, ``node`` when the record carries them
(``log.info(..., extra={"job": ...})``) -- for a log pipeline to index.

The format and the role travel to every process of a role in the environment
(``IOP_LOG_FORMAT``, ``IOP_LOG_ROLE``): uvicorn's server processes build the app
themselves, and set up their logging from there (``api/app.py``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Record attributes copied into a JSON line when a log call passes them in ``extra``.
CONTEXT = ("job", "model", "provider", "node", "tenant")


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role or os.environ.get("IOP_LOG_ROLE", "")

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "role": self.role,
            "logger": record.name,
            "event": record.getMessage(),
        }
        for name in CONTEXT:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(level: str, fmt: str | None = None, role: str | None = None) -> None:
    """Set up the root logger (and uvicorn's) for this process; remembers the choice in the
    environment for the processes it starts."""
    fmt = fmt or os.environ.get("IOP_LOG_FORMAT", "text")
    if role:
        os.environ["IOP_LOG_ROLE"] = role
    os.environ["IOP_LOG_FORMAT"] = fmt
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(role) if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logger = logging.getLogger(name)
            logger.handlers[:] = []
            logger.propagate = True


def uvicorn_config(level: str) -> dict[str, Any] | None:
    """uvicorn's ``log_config``: its own (text) unless JSON was asked for, then none of its
    handlers, so its records reach the root logger's JSON lines."""
    if os.environ.get("IOP_LOG_FORMAT", "text") != "json":
        return None
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "iop.logs.JsonFormatter"}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["default"], "level": level.upper()},
        "loggers": {name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error",
                                                                              "uvicorn.access")},
    }
