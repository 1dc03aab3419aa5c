"""Root tasks are guarded: one that dies stops the daemon with a non-zero exit, naming it."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

from dynaresized.daemon.config import config_from_dict
from dynaresized.daemon.logs import configure_logging
from dynaresized.daemon.service import Daemon

from .conftest import daemon_sections


async def test_a_dying_root_task_stops_the_daemon_with_exit_1(tmp_path: Path) -> None:
    sections = daemon_sections(tmp_path)
    sections["daemon"]["metrics_port"] = 0
    daemon = Daemon(config_from_dict(sections))

    async def broken_ticker() -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("the clock fell off the wall")

    daemon._ticker = broken_ticker  # type: ignore[method-assign]
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    try:
        code = await asyncio.wait_for(daemon.run(), timeout=20)
    finally:
        configure_logging("json", "info")
    assert code == 1
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    died = [x for x in lines if x["event"] == "root task ended unexpectedly"]
    assert died and died[0]["task"] == "ticker" and "the clock fell off the wall" in died[0]["error"]
