"""Where vLLM's own log lines go, and the one known-harmless warning they drop.

`vllm_logging_config(path)` is a `logging.config.dictConfig` that sends vLLM's loggers and
Python warnings to a file; `route_vllm_logs(path)` writes it next to the file and points
`VLLM_LOGGING_CONFIG_PATH` at it, so vLLM's engine-core processes, which configure their
logging when they import vLLM, write there too.

Why `RotaryEmbedding: Failed to load weights` is harmless: vLLM's layer-wise reload
(`model_executor/model_loader/reload/layerwise.py`) counts every parameter *and buffer* of a
layer as something the checkpoint must provide. `RotaryEmbedding` has no parameter; its only
tensor is `cos_sin_cache`, a non-persistent buffer (`persistent=False`) computed from the
model config, which no checkpoint contains. So on every reload_weights that layer "loads"
0 elements, vLLM warns, and then puts the layer's kept tensors back (`_place_kernel_tensors`):
the cache is exactly what it was. tests/backends/vllm/test_vllm_logs.py checks the layer's
tensors; test_vllm_rollout.py's reference test checks that greedy outputs after a reload equal
transformers' on the same weights (wrong rotary positions would change them).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
HARMLESS_RELOAD_WARNING = "RotaryEmbedding: Failed to load weights"


class HarmlessReloadWarning(logging.Filter):
    """Drops vLLM's per-reload `RotaryEmbedding: Failed to load weights` (see the module
    docstring for why it is harmless); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == LAYERWISE_LOGGER and record.getMessage() == HARMLESS_RELOAD_WARNING)


def drop_harmless_reload_warning() -> None:
    """Attach the filter to vLLM's layer-wise reload logger in this process (and in engine-core
    processes forked from it). Idempotent."""
    logger = logging.getLogger(LAYERWISE_LOGGER)
    if not any(isinstance(x, HarmlessReloadWarning) for x in logger.filters):
        logger.addFilter(HarmlessReloadWarning())


def vllm_logging_config(path: Path, level: str = "INFO") -> dict[str, Any]:
    """vLLM's loggers and Python warnings to `path` (appended), one line per record."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"harmless": {"()": f"{__name__}.HarmlessReloadWarning"}},
        "formatters": {"line": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "mode": "a",
                              "formatter": "line", "filters": ["harmless"], "level": level}},
        "loggers": {"vllm": {"handlers": ["file"], "level": level, "propagate": False},
                    "py.warnings": {"handlers": ["file"], "level": "WARNING", "propagate": False}},
    }


def route_vllm_logs(path: Path, level: str = "INFO") -> Path:
    """Send vLLM's logs (this process and the engine cores it starts) and Python warnings to
    `path`. Call it before vLLM is imported; returns the config file written next to `path`."""
    import logging.config

    config = vllm_logging_config(path, level)
    config_path = path.with_name(path.stem + "-logging.json")
    config_path.write_text(json.dumps(config, indent=2))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
    return config_path
