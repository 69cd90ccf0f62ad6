"""Horus: jobs, their graph features and utilisation predictions, for a person at a terminal.

``phasewise submit`` publishes a job; ``phasewise predict`` scores the
utilisation model on profiled jobs.
"""
