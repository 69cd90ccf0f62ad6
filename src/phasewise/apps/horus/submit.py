"""``phasewise submit JOB.json|yaml``: publish a job-submitted event on ``phasewise.job-events.v1``, signed
with a submitter key when one is given; a bad spec (an unknown key at any level, loss targets in the wrong
order for their direction) is one line and exit status 2, nothing published; an id the job events already
hold is refused, exit status 1 (docs/horus.md, "Submitting a job"; docs/jobs.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from phasewise.kit.command import add_common, add_setting, settings_from_args
from phasewise.kit.records import JobEvent, JobRequests, JobSpec, JobTargets, SchemaError, encode_within, from_dict
from phasewise.kit.records.jobs import closest_name, targets_problem, unknown_field
from phasewise.models.horus.catalog import (
    DATASETS,
    MODELS,
    canonical_dataset,
    canonical_model,
    entry_point_refusal,
    is_entry_point,
    parse_module_list,
)

_TOP = {"job", "workload", "priority", "spec"}
_SPEC = {f for f in JobSpec.__dataclass_fields__}


class SpecError(ValueError):
    """A job file that is not a valid job; ``str(e)`` is the one-line reason."""


def read_file(path: Path) -> Any:
    """The JSON (or, with PyYAML installed, YAML) value in *path*."""
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not UTF-8 text") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SpecError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); "
                            "or write the job as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
        except RecursionError:
            raise SpecError(f"{path}: not valid YAML: nested too deeply") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise SpecError(f"{path}: not valid JSON: arrays or objects nested too deeply to parse") from None


def check_names(spec: JobSpec) -> None:
    """Refuse a model or dataset name that is neither in the catalog nor a ``module:function``."""
    if canonical_model(spec.model) is None and not is_entry_point(spec.model):
        raise SpecError(f"spec.model: unknown model {spec.model!r}: neither a catalog name "
                        f"({', '.join(MODELS)}) nor module:function")
    if canonical_dataset(spec.dataset) is None:
        raise SpecError(f"spec.dataset: unknown dataset {spec.dataset!r} (known: {', '.join(DATASETS)})")


def job_event(data: Any, *, job: str | None = None, ts: float | None = None) -> JobEvent:
    """The ``submitted`` event of a job file's value; :class:`SpecError` says what is wrong."""
    if type(data) is not dict:
        raise SpecError(f"expected an object (the job), got {type(data).__name__}")
    unknown = sorted(set(data) - _TOP - _SPEC)
    if unknown:
        near = closest_name(str(unknown[0]), _TOP | _SPEC)
        raise SpecError(f"unknown field {unknown[0]!r} ({f'did you mean {near!r}? ' if near else ''}"
                        f"a job has {', '.join(sorted(_TOP | _SPEC))})")
    if "spec" in data:
        inline = sorted(set(data) & _SPEC)
        if inline:
            raise SpecError(f"field {inline[0]!r} is given both at the top level and under 'spec'")
        spec = data["spec"]
    else:
        spec = {k: v for k, v in data.items() if k in _SPEC}
    if type(spec) is not dict:
        raise SpecError("spec: expected an object")
    # the record's decoder skips keys it does not know (a newer writer's): a person's file must not lose one
    for value, cls, where in ((spec, JobSpec, "spec"), (spec.get("requests"), JobRequests, "spec.requests"),
                              (spec.get("targets"), JobTargets, "spec.targets")):
        if type(value) is dict and (why := unknown_field(value, cls, where)) is not None:
            raise SpecError(why)
    name = job or data.get("job")
    if name is None:
        model = str(spec.get("model", "job")).rpartition(":")[2]
        name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in model)[:40] + f"-{os.urandom(4).hex()}"
    event = {"v": JobEvent.VERSION, "job": name, "ts": time.time() if ts is None else ts, "kind": "submitted",
             "spec": spec, **{k: data[k] for k in ("workload", "priority") if k in data}}
    try:
        rec = from_dict(JobEvent, event)
        encode_within(rec)  # (the whole event too: what a consumer refuses is not published)
    except SchemaError as e:
        raise SpecError(str(e).removeprefix("JobEvent: ")) from None
    check_names(rec.spec)
    if (why := targets_problem(rec.spec.targets)) is not None:
        raise SpecError(f"spec.{why}")
    return rec


def already_submitted(settings: Any, job: str, timeout_s: float) -> str | None:
    """Whether the job events hold a ``submitted`` event of *job* (read back from the partition its key goes
    to, to its end): the one-line reason it is refused, or ``None``. :class:`TimeoutError` when the partition
    could not be read to its end within *timeout_s*."""
    import uuid

    from confluent_kafka import KafkaError, TopicPartition

    from phasewise.kit.kafka.client import make_consumer
    from phasewise.kit.records import decode
    from phasewise.kit.topics import JOB_EVENTS

    deadline = time.monotonic() + timeout_s
    key = job.encode()
    c = make_consumer(settings, f"phasewise-submit-{uuid.uuid4().hex[:12]}", **{"enable.partition.eof": True})
    try:
        meta = c.list_topics(JOB_EVENTS.name, timeout=max(1.0, timeout_s / 3)).topics.get(JOB_EVENTS.name)
        if meta is None or meta.error is not None or not meta.partitions:
            return None  # no job events yet
        # librdkafka's default partitioner (the producer below): CRC32 of the key
        part = zlib.crc32(key) % len(meta.partitions)
        lo, hi = c.get_watermark_offsets(TopicPartition(JOB_EVENTS.name, part), timeout=max(1.0, timeout_s / 3))
        if hi <= lo:
            return None
        c.assign([TopicPartition(JOB_EVENTS.name, part, lo)])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"could not read {JOB_EVENTS.name}[{part}] to its end within {timeout_s:g} s")
            m = c.poll(min(left, 1.0))
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    return None
                continue
            if m.key() == key:
                try:
                    ev = decode(JobEvent, m.value())
                except SchemaError:
                    continue
                if ev.kind == "submitted":
                    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ev.ts))
                    return (f"job id {job} already submitted (at {when}, {JOB_EVENTS.name}[{part}]@{m.offset()}): "
                            f"submit it under another id (--job NAME)")
            if m.offset() >= hi - 1:
                return None
    finally:
        c.close()


def model_note(spec: JobSpec, model_modules: str) -> str | None:
    """A note when *spec*'s model is a ``module:function`` that a horus with *model_modules* does not build."""
    if canonical_model(spec.model) is not None or not is_entry_point(spec.model):
        return None
    why = entry_point_refusal(spec.model, parse_module_list(model_modules))
    if why is None:
        return None
    return (f"model {spec.model} is predicted only by a horus whose horus_model_modules lists its module "
            f"(here: {why.split(';')[0]}); without a prediction it is placed by its requests")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p)
    add_setting(p, "job_submitter_key_file")
    p.add_argument("file", metavar="JOB", help="the job as JSON (or YAML with PyYAML installed)")
    p.add_argument("--job", help="job id (default: the file's 'job', else the model's name and a random suffix)")
    p.add_argument("--dry-run", action="store_true", help="check and print the event; publish nothing")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                   help="give up when the broker has not confirmed within this long (default 30)")


def run(args: argparse.Namespace) -> int:
    prog = "phasewise submit"
    try:
        event = job_event(read_file(Path(args.file)), job=args.job)
    except SpecError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    s = settings_from_args(args)
    note = model_note(event.spec, s.horus.model_modules)
    if note is not None:
        print(f"{prog}: note: {note}", file=sys.stderr)
    if s.jobs.submitter_key_file:
        from phasewise.kit.job_signing import JobSigningError, key_id, load_private_key, sign_event

        try:
            key = load_private_key(s.jobs.submitter_key_file)
        except JobSigningError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        event = sign_event(key, event)
        signed = f"signed by submitter key {key_id(key.public_key())}"
    else:
        signed = "unsigned"
        what = ("it can be placed and predicted, but no actuator starts its command" if event.spec.command
                else "it can be placed and predicted")
        print(f"{prog}: warning: job {event.job} is published unsigned (no --key, job_submitter_key_file empty): "
              f"{what}", file=sys.stderr)
    try:
        value = encode_within(event)  # (signed: the signature's few hundred bytes count too)
    except SchemaError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(value.decode())
        return 0
    from phasewise.kit.kafka.client import BrokerUnavailable, make_producer, wait_for_broker
    from phasewise.kit.topics import JOB_EVENTS

    try:
        wait_for_broker(s, timeout_s=args.timeout)
    except BrokerUnavailable as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    try:
        why = already_submitted(s, event.job, args.timeout)
    except TimeoutError as e:  # (a long partition on a slow link): the agents still refuse a known id
        print(f"{prog}: warning: {e}, to check that job id {event.job} is new: published unchecked (the agents "
              f"refuse an id they know as a dead letter)", file=sys.stderr)
        why = None
    if why is not None:
        print(f"{prog}: error: {why}", file=sys.stderr)
        return 1
    errors: list[str] = []
    producer = make_producer(s, partitioner="consistent_random")  # (what already_submitted reads back)
    producer.produce(JOB_EVENTS.name, key=event.job.encode(), value=value,
                     on_delivery=lambda err, _msg: err and errors.append(err.str()))
    left = producer.flush(args.timeout)
    if left or errors:
        print(f"{prog}: job {event.job} not confirmed by the broker: {errors[0] if errors else 'timed out'}",
              file=sys.stderr)
        return 1
    print(f"submitted {event.job} ({event.spec.model} on {event.spec.dataset}, batch {event.spec.batch_size}) "
          f"to {JOB_EVENTS.name}, {signed}")
    return 0
