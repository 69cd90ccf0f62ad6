"""Online per-feature normaliser for usage frames (``log1p`` where asked, running z-scores, clipped; NaN
skipped), one per model. docs/phases.md, "The model".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from phasewise.models.phases.checkpoint import pack, unpack

__all__ = ["OnlineNormalizer"]


class OnlineNormalizer:
    """Running standardiser over a fixed number of features.

    Parameters
    ----------
    n_features
        Number of features per frame.
    log_features
        Per feature, whether to apply ``log1p(max(x, 0))`` before
        standardising (use it for bytes and cores; not for percentages).
        ``None`` means no feature is log-transformed.
    clip
        Standardised values are clipped to ``[-clip, clip]``.
    min_std
        Floor on the standard deviation (in transformed units), so a feature
        that has been constant so far does not blow up.

    Examples
    --------
    >>> import numpy as np
    >>> norm = OnlineNormalizer(2, log_features=(False, False))
    >>> norm.learn_many(np.array([[1.0, 10.0], [3.0, 30.0]]))
    >>> norm.mean.tolist(), norm.std.round(3).tolist()
    ([2.0, 20.0], [1.0, 10.0])
    >>> norm.transform_many(np.array([[3.0, np.nan]])).tolist()
    [[1.0, 0.0]]
    >>> OnlineNormalizer.from_bytes(norm.to_bytes()).mean.tolist()
    [2.0, 20.0]
    """

    VERSION = 1

    def __init__(
        self,
        n_features: int,
        log_features: Sequence[bool] | None = None,
        clip: float = 5.0,
        min_std: float = 1e-3,
    ) -> None:
        if n_features < 1:
            raise ValueError(f"n_features must be >= 1, got {n_features}")
        if log_features is not None and len(log_features) != n_features:
            raise ValueError(
                f"log_features has {len(log_features)} entries for {n_features} features"
            )
        self.n_features = int(n_features)
        self.log_features = tuple(bool(x) for x in log_features) if log_features else (False,) * n_features
        self.clip = float(clip)
        self.min_std = float(min_std)
        self._log_mask = np.array(self.log_features, dtype=bool)
        self._n = np.zeros(n_features, dtype=np.float64)
        self._mean = np.zeros(n_features, dtype=np.float64)
        self._m2 = np.zeros(n_features, dtype=np.float64)

    # ------------------------------------------------------------------ helpers
    def _pre(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if X.shape[-1] != self.n_features:
            raise ValueError(f"expected {self.n_features} features per frame, got {X.shape[-1]}")
        if self._log_mask.any():
            X = X.copy()
            X[..., self._log_mask] = np.log1p(np.maximum(X[..., self._log_mask], 0.0))
        return X

    @property
    def count(self) -> np.ndarray:
        """Per-feature number of (non-missing) values learned."""
        return self._n.copy()

    @property
    def mean(self) -> np.ndarray:
        """Per-feature running mean (in transformed units)."""
        return self._mean.copy()

    @property
    def std(self) -> np.ndarray:
        """Per-feature running population standard deviation, floored at ``min_std``."""
        var = np.divide(self._m2, self._n, out=np.zeros_like(self._m2), where=self._n > 0)
        return np.maximum(np.sqrt(var), self.min_std)

    # ------------------------------------------------------------------ learning
    def learn_one(self, x: Sequence[float] | dict) -> None:
        """Learn one frame (a sequence, or a dict whose values are in feature order)."""
        if isinstance(x, dict):
            x = list(x.values())
        self.learn_many(np.asarray(x, dtype=np.float64)[None, :])

    def learn_many(self, X: np.ndarray) -> None:
        """Learn a batch of frames, shape ``(n, n_features)`` (NaN = missing)."""
        Y = self._pre(X).reshape(-1, self.n_features)
        ok = np.isfinite(Y)
        nb = ok.sum(axis=0).astype(np.float64)
        if not nb.any():
            return
        Yz = np.where(ok, Y, 0.0)
        safe = np.maximum(nb, 1.0)
        mb = Yz.sum(axis=0) / safe
        m2b = (np.where(ok, Y - mb, 0.0) ** 2).sum(axis=0)
        n = self._n + nb
        delta = mb - self._mean
        frac = np.divide(nb, n, out=np.zeros_like(n), where=n > 0)
        self._mean = self._mean + delta * frac
        self._m2 = self._m2 + m2b + delta**2 * self._n * frac
        self._n = n

    # ------------------------------------------------------------------ transform
    def transform_many(self, X: np.ndarray) -> np.ndarray:
        """Standardise frames of any leading shape ``(..., n_features)``; NaN -> 0."""
        Y = (self._pre(X) - self._mean) / self.std
        Y = np.nan_to_num(Y, nan=0.0, posinf=self.clip, neginf=-self.clip)
        return np.clip(Y, -self.clip, self.clip, out=Y)

    def transform_one(self, x: Sequence[float]) -> np.ndarray:
        """Standardise one frame."""
        return self.transform_many(np.asarray(x, dtype=np.float64)[None, :])[0]

    # ------------------------------------------------------------------ checkpoint
    def to_bytes(self) -> bytes:
        """Versioned checkpoint (see :mod:`phasewise.models.phases.checkpoint`)."""
        meta = {
            "n_features": self.n_features,
            "log_features": list(self.log_features),
            "clip": self.clip,
            "min_std": self.min_std,
        }
        return pack("OnlineNormalizer", self.VERSION, meta, {"n": self._n, "mean": self._mean, "m2": self._m2})

    @classmethod
    def from_bytes(cls, data: bytes) -> OnlineNormalizer:
        """Load a checkpoint written by :meth:`to_bytes` (same version only)."""
        meta, arr = unpack(data, "OnlineNormalizer", cls.VERSION)
        obj = cls(**meta)
        obj._n, obj._mean, obj._m2 = arr["n"], arr["mean"], arr["m2"]
        return obj

    def clone(self) -> OnlineNormalizer:
        """An independent copy with the same learned state."""
        return self.from_bytes(self.to_bytes())
