"""``phasewise demo``: the whole closed loop on this machine, with real training jobs.

- :mod:`~phasewise.demo.run`: the flags, and the run: broker, cgroups, roles,
  jobs, the loop, the cleanup;
- :mod:`~phasewise.demo.jobs`: the training jobs (``python -m phasewise.demo.jobs``);
- :mod:`~phasewise.demo.summary`: what the demo saw and its summary (pure);
- :mod:`~phasewise.demo.view`: the live terminal view.
"""
