"""``phasewise experiment``: experiments that run real jobs under a policy and report what it changed; one
module per experiment (``targets``, ``curves``, ``priorities``), dispatched by ``cli``.
"""
