"""vLLM's log lines: the filter drops exactly the one harmless reload warning, the routed config
sends vLLM and Python warnings to a file, and the facts that make the warning harmless hold for
the vLLM installed here (the rotary layer has nothing a checkpoint could provide)."""

from __future__ import annotations

import json
import logging
import logging.config
import warnings
from pathlib import Path

import pytest

from dynaresized.backends.vllm.logs import (
    HARMLESS_RELOAD_WARNING,
    LAYERWISE_LOGGER,
    HarmlessReloadWarning,
    vllm_logging_config,
)


def record(name: str, message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


def test_the_filter_drops_only_the_harmless_reload_warning() -> None:
    f = HarmlessReloadWarning()
    assert not f.filter(record(LAYERWISE_LOGGER, HARMLESS_RELOAD_WARNING))
    assert f.filter(record(LAYERWISE_LOGGER, "QKVParallelLinear: Failed to load weights"))  # a real one
    assert f.filter(record("vllm.other", HARMLESS_RELOAD_WARNING))
    # vLLM formats it lazily: "%s: Failed to load weights" % "RotaryEmbedding"
    lazy = logging.LogRecord(LAYERWISE_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights",
                             ("RotaryEmbedding",), None)
    assert not f.filter(lazy)


def test_the_config_sends_vllm_and_warnings_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "engines.log"
    config = vllm_logging_config(path)
    json.dumps(config)  # vLLM reads it from a JSON file
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
             for name in ("vllm", "py.warnings")}
    try:
        logging.config.dictConfig(config)
        logging.captureWarnings(True)
        logging.getLogger(LAYERWISE_LOGGER).warning("%s: Failed to load weights", "RotaryEmbedding")
        logging.getLogger("vllm.engine").warning("an engine warning")
        warnings.warn("a library warning", FutureWarning, stacklevel=1)
        for handler in logging.getLogger("vllm").handlers:
            handler.flush()
        text = path.read_text()
        assert "an engine warning" in text and "a library warning" in text
        assert HARMLESS_RELOAD_WARNING not in text
    finally:
        logging.captureWarnings(False)
        for name, (handlers, propagate) in saved.items():
            logger = logging.getLogger(name)
            for handler in logger.handlers:
                handler.close()
            logger.handlers[:] = handlers
            logger.propagate = propagate


def test_the_rotary_layer_has_nothing_a_checkpoint_could_load() -> None:
    pytest.importorskip("vllm", reason="checks vLLM's RotaryEmbedding (the vllm extra)")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_size

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(head_size=16, max_position=64, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    params, buffers = get_layer_params_buffers(rope)
    assert params == {} and set(buffers) == {"cos_sin_cache"}
    assert rope.state_dict() == {}  # non-persistent: never saved, so never in a checkpoint
    assert get_layer_size(rope) > 0  # ...yet the layer-wise reload expects elements: hence the warning
    # the cache is a function of the config alone: recomputing it gives the same tensor
    assert torch.equal(rope._compute_cos_sin_cache().to(rope.cos_sin_cache.dtype), rope.cos_sin_cache)
