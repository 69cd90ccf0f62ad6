"""``python -m phasewise.kit.settings > docs/configuration.md``: print the configuration reference."""

from phasewise.kit.settings.reference import reference

print(reference(), end="")
