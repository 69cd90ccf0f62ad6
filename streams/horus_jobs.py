"""A job spec's graph features: the catalog's models, or a user's ``module:function`` imported here.

Importing a user's module runs its code, so it lives in the roles' room, not
in ``models/``; what the import returns goes to the pure
:func:`phasewise.models.graph_features.features`. Every failure (no such
module or function, an import that raises, a model that fails to build or to
run a batch, an absurd batch size, an unknown dataset) is a
:class:`~phasewise.models.graph_features.FeatureError` with the reason.
"""

from __future__ import annotations

import importlib
from typing import Any

from phasewise.models.graph_features import FeatureError, GraphFeatures, catalog_features, features
from phasewise.models.horus_catalog import DATASETS, MODELS, canonical_dataset, canonical_model, is_entry_point
from phasewise.schemas import JobSpec

__all__ = ["spec_features", "model_key", "resolve_entry_point"]

_CACHE: dict[tuple[str, str, int, bool], GraphFeatures] = {}


def model_key(name: str) -> str:
    """The name jobs of this model share (catalog canonical name, or the entry point as given)."""
    return canonical_model(name) or name


def resolve_entry_point(name: str) -> Any:
    """The callable ``module:function`` names; :class:`FeatureError` when there is none."""
    if not is_entry_point(name):
        raise FeatureError(f"unknown model {name!r}: neither a catalog name nor module:function")
    mod, _, fn = name.partition(":")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # ImportError, or whatever the module's top level raises
        raise FeatureError(f"model {name}: cannot import {mod}: {type(e).__name__}: {e}") from None
    func = getattr(module, fn, None)
    if not callable(func):
        raise FeatureError(f"model {name}: {mod} has no callable {fn!r}")
    return func


def spec_features(spec: JobSpec) -> GraphFeatures:
    """The graph features of one training step of the job *spec* describes (cached per model/data/batch/amp)."""
    if canonical_model(spec.model) is not None:
        return catalog_features(spec.model, spec.dataset, spec.batch_size, spec.amp)
    if not is_entry_point(spec.model):
        raise FeatureError(f"unknown model {spec.model!r}: neither a catalog name ({', '.join(MODELS)}, "
                           f"mlp-...) nor module:function")
    ds = canonical_dataset(spec.dataset)
    if ds is None:
        raise FeatureError(f"unknown dataset {spec.dataset!r} (known: {', '.join(DATASETS)})")
    key = (spec.model, ds, spec.batch_size, spec.amp)
    if key not in _CACHE:
        build = resolve_entry_point(spec.model)
        _CACHE[key] = features(build, name=spec.model, shape=DATASETS[ds], batch=spec.batch_size, amp=spec.amp)
    return _CACHE[key]
