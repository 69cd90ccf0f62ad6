"""``phasewise experiment``: experiments that run real jobs under a policy and report what it changed.

One subcommand per experiment (:data:`phasewise.apps.experiment.cli.EXPERIMENTS`); each
module exposes ``add_arguments(parser)`` and ``run(args) -> int`` like a role.
"""
