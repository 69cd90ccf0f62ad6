"""``phasewise jobs`` and ``phasewise tail``: the jobs as the records tell them, and any topic decoded.

Both read the topics as a subscriber does (assigned partitions, no consumer group, nothing committed):
:mod:`~phasewise.apps.jobs.read` reads them from a start to their end (or on), :mod:`~phasewise.apps.jobs.cli`
folds them with :mod:`phasewise.models.jobs.view`, :mod:`~phasewise.apps.jobs.tail` prints records.
Narrative: docs/jobs.md, "Watching jobs".
"""
