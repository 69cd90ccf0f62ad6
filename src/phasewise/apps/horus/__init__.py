"""Horus for a person at a terminal: ``phasewise submit`` publishes a job, ``phasewise predict`` scores the
utilisation model on profiled jobs (docs/horus.md).
"""
