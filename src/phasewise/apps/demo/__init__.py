"""``phasewise demo``: the whole closed loop on this machine, with real training jobs: ``run`` (the flags and
the run), ``jobs`` (the training jobs), ``summary`` (what it saw, pure), ``view`` (the live terminal view).
"""
