"""The job agents' scaffold without Faust: a step's outcome or its record's dead letter, by kind; a record
that does not decode is a dead letter of kind schema (``Context.decoded``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from phasewise.kit.records import JobEvent, SchemaError, decode
from phasewise.models.jobs.events import EventTimeRefused, Refused, SignatureRefused
from phasewise.streams.agents.scaffold import Context, step_outcome


def outcome(step):
    dead: list[tuple[str, str]] = []

    async def dead_letter(event, reason, kind):
        dead.append((reason, kind))

    ctx = Context(None, None, None, None, None, None, dead_letter, None)  # (only its dead letters are used)
    event = SimpleNamespace(message=SimpleNamespace(value=b"{}"))
    return asyncio.run(step_outcome(ctx, event, step, "the step failed")), dead


def test_a_step_s_answer_is_returned_and_nothing_is_dead_lettered():
    assert outcome(lambda msg: ([1], [2])) == (([1], [2]), [])


def test_each_refusal_is_a_dead_letter_of_its_kind_and_a_bug_one_of_kind_processing():
    def raising(e):
        def step(msg):
            raise e
        return step

    try:
        decode(JobEvent, b"[")
    except SchemaError as e:
        bad = e
    cases = [(bad, "schema"), (Refused("no spec"), "refused"), (Refused("unusable", "schema"), "schema"),
             (SignatureRefused("unsigned"), "signature"), (EventTimeRefused("far ahead"), "event_time"),
             (KeyError("x"), "processing")]
    for e, kind in cases:
        got, dead = outcome(raising(e))
        assert got is None and [k for _, k in dead] == [kind], (e, dead)
    assert outcome(raising(KeyError("x")))[1][0][0] == "processing failed: KeyError: 'x'"


def test_a_record_that_does_not_decode_is_a_schema_dead_letter_and_a_good_one_is_returned():
    dead: list[tuple[str, str]] = []

    async def dead_letter(event, reason, kind):
        dead.append((reason, kind))

    ctx = Context(None, None, None, None, None, None, dead_letter, None)

    def read(raw):
        return decode(JobEvent, raw)

    bad = SimpleNamespace(message=SimpleNamespace(value=b"["))
    good = SimpleNamespace(message=SimpleNamespace(value=b'{"v": 1, "job": "a", "ts": 1.0, "kind": "finished"}'))
    assert asyncio.run(ctx.decoded(bad, read)) is None and [k for _, k in dead] == ["schema"]
    assert asyncio.run(ctx.decoded(good, read)).job == "a" and len(dead) == 1
