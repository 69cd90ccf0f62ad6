"""``phasewise demo``: the whole closed loop on this machine, with real training jobs.

- :mod:`~phasewise.apps.demo.run`: the flags, and the run: broker, cgroups, roles,
  jobs, the loop, the cleanup;
- :mod:`~phasewise.apps.demo.jobs`: the training jobs (``python -m phasewise.apps.demo.jobs``);
- :mod:`~phasewise.apps.demo.summary`: what the demo saw and its summary (pure);
- :mod:`~phasewise.apps.demo.view`: the live terminal view.
"""
