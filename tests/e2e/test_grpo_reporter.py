"""The GRPO example reports every step through one worker: the daemon takes a job's step
reports from the first worker that sent one, for as long as it is live, and refused the rest
(`not_the_reporter`). The driver reported through whichever engine was admitted, so after a
resize every step line said "not yet observed by the daemon"."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="the GRPO driver imports the torch extra")

from examples.grpo_tiny.run import Driver  # noqa: E402

pytestmark = [pytest.mark.torch]


class Client:
    def __init__(self, name: str, sent: list[str]) -> None:
        self.name, self.sent = name, sent

    async def report_step(self, timing: object) -> None:
        self.sent.append(self.name)


def test_every_step_goes_through_the_worker_that_reported_the_first() -> None:
    sent: list[str] = []
    driver = Driver.__new__(Driver)  # only what report() reads
    driver.workers = {f"d{i}": SimpleNamespace(client=Client(f"engine{i}", sent), engine=SimpleNamespace(
        engine_id=f"engine{i}")) for i in range(3)}
    driver.router = SimpleNamespace(admitted={"engine2"})
    driver.reporter = None
    result = SimpleNamespace(timing=lambda **kw: kw)

    async def steps() -> None:
        await driver.report(result, 1.0, 1)  # the first: an admitted engine's worker
        driver.router.admitted = {"engine1"}  # a resize: engine2's device trains now
        await driver.report(result, 1.0, 2)
        driver.workers["d2"].client = None  # that worker is gone: another one takes over
        await driver.report(result, 1.0, 2)

    asyncio.run(steps())
    assert sent == ["engine2", "engine2", "engine1"]
