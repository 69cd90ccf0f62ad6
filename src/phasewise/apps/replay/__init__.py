"""``phasewise replay``: replay a real usage trace through limit policies and score them.

The modules, each importing only those listed before it: ``traces`` (the
loaders), ``policies`` (the families), ``results`` (scores, savings, the
table), ``driving`` (policies through a trace), ``through_kafka`` (the same
through a broker and a real worker), ``report`` (plots and ``summary.md``),
``cli``. docs/results.md.
"""
