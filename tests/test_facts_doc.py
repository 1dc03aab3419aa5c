"""docs/facts.md is what `python -m dynaresized.fact_doc` renders from the fact classes, and
`dynaresized events --json` prints exactly the keys it documents, for every fact type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynaresized import fact_doc
from dynaresized.cli import main
from dynaresized.core import facts
from dynaresized.daemon.service import EVENTS_FILE
from dynaresized.store import FactLog, open_recorder

DOC = Path(__file__).resolve().parents[1] / "docs" / "facts.md"
REGENERATE = f"regenerate it with `.venv/bin/{fact_doc.COMMAND}` and commit it with the change"


def test_the_committed_fact_schema_is_what_the_code_renders() -> None:
    assert DOC.read_text() == fact_doc.render(), (
        f"docs/facts.md is out of date with the fact classes (dynaresized/core/facts.py and the types they "
        f"use): {REGENERATE}")


@pytest.mark.parametrize("cls", facts.FACT_TYPES, ids=lambda c: c.__struct_config__.tag)
def test_every_fact_type_says_when_it_is_written(cls: type[facts.Fact]) -> None:
    assert (cls.__doc__ or "").strip(), (
        f"{cls.__name__} has no docstring: say there when the daemon writes it (docs/facts.md renders it); "
        f"then {REGENERATE}")


def sample(info: Any) -> Any:
    """A value of the type `info` describes (msgspec.inspect), required fields only."""
    mi = msgspec.inspect
    if isinstance(info, mi.StructType):
        return info.cls(**{f.name: sample(f.type) for f in info.fields if f.required})
    if isinstance(info, mi.UnionType):
        return sample(next(t for t in info.types if not isinstance(t, mi.NoneType)))
    if isinstance(info, mi.EnumType):
        return next(iter(info.cls))
    if isinstance(info, (mi.VarTupleType, mi.ListType, mi.TupleType)):
        return ()
    if isinstance(info, mi.DictType):
        return {}
    return {mi.IntType: 1, mi.FloatType: 1.5, mi.StrType: "x", mi.BoolType: True}.get(type(info))


def test_events_json_prints_the_documented_keys_for_every_fact_type(tmp_path: Path, capsys) -> None:
    written = [sample(msgspec.inspect.type_info(cls)) for cls in facts.FACT_TYPES]
    log = FactLog(open_recorder(tmp_path / EVENTS_FILE))
    log.append(written)
    log.close()
    assert main(["events", "--json", "--state-dir", str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["type"] for line in lines] == [cls.__struct_config__.tag for cls in facts.FACT_TYPES]
    rendered = fact_doc.render()
    for position, (fact, line) in enumerate(zip(written, lines, strict=True), start=1):
        cls = type(fact)
        assert list(line) == fact_doc.fact_keys(cls), cls.__name__
        assert line["position"] == position and isinstance(line["recorded_at"], float)
        stored = {k: v for k, v in line.items() if k not in ("position", "recorded_at", *fact_doc.DERIVED)}
        assert msgspec.json.decode(json.dumps(stored), type=facts.AnyFact) == fact  # the fact, nothing lost
        assert f"### `{line['type']}`" in rendered


def test_field_notes_come_from_the_code() -> None:
    notes = fact_doc.field_notes(facts.ResizeStarted)
    assert notes["payback_steps"] == "steps after the commit over which the resize is judged"
    from dynaresized.domain import StepTiming

    assert fact_doc.field_notes(StepTiming)["rollout_device_s"].startswith("Device-seconds that served the rollout")
