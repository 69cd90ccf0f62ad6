"""``python -m phasewise.cli``: the one CLI (:func:`phasewise.cli.main`)."""

from phasewise.cli import main

raise SystemExit(main())
