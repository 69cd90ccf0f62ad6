"""``phasewise replay``: replay a real usage trace through limit policies and score them.

Each container of the trace is replayed on its own, with a fresh instance of
every policy; a policy is asked for its limits at ``t`` before it is shown
the usage measured at ``t``. Per resource, scores are summed over containers
(:mod:`phasewise.models.scoring.measures`), and the phase policy is compared with the
reactive baselines' frontier. The modules, each importing only those above it:

- :mod:`~phasewise.apps.replay.traces`: the trace loaders (ai4dl, genai2026) and the
  AI4DL sample phasewise ships;
- :mod:`~phasewise.apps.replay.policies`: the policy families, their specs and
  factories, :class:`~phasewise.apps.replay.policies.ScaledPolicy`;
- :mod:`~phasewise.apps.replay.results`: scores per resource, the rows printed,
  the savings against the reactive frontier, the text table;
- :mod:`~phasewise.apps.replay.driving`: driving policies through a trace (one
  container, or one shared phase model for the fleet) and scoring them;
- :mod:`~phasewise.apps.replay.through_kafka`: the same trace through a broker and a real
  ``phasewise worker`` (``--through-kafka``), or the worker's own step
  in-process (``--phase-model worker``);
- :mod:`~phasewise.apps.replay.report`: the PNG plots and ``summary.md`` (``--report``);
- :mod:`~phasewise.apps.replay.cli`: the flags and the run.

The schema of ``--json`` output is the kit's :mod:`phasewise.kit.records.replay_output`
(``phasewise schemas`` writes it with the topics' schemas).
"""
