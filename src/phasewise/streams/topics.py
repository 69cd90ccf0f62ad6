"""Faust handles on phasewise's topics (names and keys: :mod:`phasewise.kit.topics`).

Values and keys travel as raw bytes: the agents parse them with
:func:`phasewise.kit.records.decode` themselves, so a malformed message becomes a
dead letter carrying our reason instead of a Faust decoding error. Topics are
created by :func:`phasewise.kit.kafka.client.ensure_topics` before the worker starts, with
the partition counts of :mod:`phasewise.kit.topics`; Faust does not declare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import faust

from phasewise.kit import topics as T

__all__ = ["WorkerTopics", "raw_topic", "worker_topics"]


@dataclass(frozen=True)
class WorkerTopics:
    samples: faust.TopicT
    decisions: faust.TopicT
    dead_letters: faust.TopicT


def raw_topic(app: faust.App, t: T.Topic, partitions: int | None = None) -> faust.TopicT:
    """The Faust handle on *t* (keys and values as raw bytes; *partitions*: its real count)."""
    return app.topic(t.name, key_serializer="raw", value_serializer="raw",
                     partitions=partitions or t.partitions, internal=False)


def worker_topics(app: faust.App, samples_partitions: int | None = None) -> WorkerTopics:
    """The worker's topics; *samples_partitions* = the samples topic's real count."""
    return WorkerTopics(
        samples=raw_topic(app, T.SAMPLES, samples_partitions),
        decisions=raw_topic(app, T.DECISIONS),
        dead_letters=raw_topic(app, T.DEAD_LETTERS),
    )
