"""Conditional Restricted Boltzmann Machine (CRBM) for usage windows, in torch (CPU), learning online.

Gaussian visible units (the current frame) and Bernoulli hidden units,
conditioned on the previous frames, trained by CD-k; randomness only from
``seed``. The equations, the choice of ``sigma`` and the window layout:
docs/phases.md, "The model".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from phasewise.models.phases.checkpoint import pack, unpack

__all__ = ["CRBM"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class CRBM:
    """Gaussian-Bernoulli conditional RBM with an online, river-style API.

    Parameters
    ----------
    n_vis
        Features per frame (e.g. 2: cpu, mem; 4: cpu, mem, gpu, gpu_mem).
    n_hid
        Hidden units (the dimension of the activations that are clustered).
    n_his
        History frames the model is conditioned on.
    sigma
        Visible noise standard deviation, in normalised units (docs/phases.md, "The model").
    lr
        Learning rate of each CD-k step.
    momentum
        Momentum of the parameter updates (0 disables it).
    weight_decay
        L2 penalty on ``W``, ``A`` and ``B``.
    k
        Gibbs steps of contrastive divergence.
    sample_hidden
        Sample binary hidden states during CD (the usual choice); ``False``
        uses probabilities throughout (deterministic, used by tests).
    init_scale
        Standard deviation of the initial weights.
    dtype
        ``"float32"`` (default) or ``"float64"``.
    seed
        Seed of the model's private random generator.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(256, 8))          # 256 windows, n_vis=2, n_his=3
    >>> model = CRBM(n_vis=2, n_hid=4, n_his=3, seed=1)
    >>> before = model.reconstruction_error(X)
    >>> for _ in range(50):
    ...     model.learn_many(X)
    >>> model.reconstruction_error(X) < before
    True
    >>> model.predict_many(X[:2]).shape
    (2, 4)
    >>> model2 = CRBM.from_bytes(model.to_bytes())
    >>> bool(np.allclose(model2.predict_many(X), model.predict_many(X)))
    True
    """

    VERSION = 1

    def __init__(
        self,
        n_vis: int = 4,
        n_hid: int = 10,
        n_his: int = 3,
        sigma: float = 0.5,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 2e-4,
        k: int = 1,
        sample_hidden: bool = True,
        init_scale: float = 0.1,
        dtype: str = "float32",
        seed: int | None = None,
    ) -> None:
        for name, val in (("n_vis", n_vis), ("n_hid", n_hid), ("k", k)):
            if int(val) < 1:
                raise ValueError(f"{name} must be >= 1, got {val}")
        if n_his < 0:
            raise ValueError(f"n_his must be >= 0, got {n_his}")
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.n_vis = int(n_vis)
        self.n_hid = int(n_hid)
        self.n_his = int(n_his)
        self.sigma = float(sigma)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.k = int(k)
        self.sample_hidden = bool(sample_hidden)
        self.init_scale = float(init_scale)
        self.dtype = dtype
        self.seed = seed

        self._dt = _DTYPES[dtype]
        self._gen = torch.Generator()
        self._gen.manual_seed(0 if seed is None else int(seed))
        n_c = self.n_his * self.n_vis
        self.W = torch.randn(self.n_hid, self.n_vis, generator=self._gen, dtype=self._dt) * self.init_scale
        self.B = torch.randn(self.n_hid, n_c, generator=self._gen, dtype=self._dt) * self.init_scale
        self.A = torch.randn(self.n_vis, n_c, generator=self._gen, dtype=self._dt) * self.init_scale
        self.b_h = torch.zeros(self.n_hid, dtype=self._dt)
        self.b_v = torch.zeros(self.n_vis, dtype=self._dt)
        self._vel = {name: torch.zeros_like(getattr(self, name)) for name in self._PARAMS}
        self._n_seen = 0
        self._n_updates = 0

    _PARAMS = ("W", "B", "A", "b_h", "b_v")

    # ------------------------------------------------------------------ shapes
    @property
    def window_size(self) -> int:
        """Values in one flat window: ``(n_his + 1) * n_vis``."""
        return (self.n_his + 1) * self.n_vis

    @property
    def n_seen(self) -> int:
        """Windows learned so far."""
        return self._n_seen

    def _as_batch(self, X: Any) -> torch.Tensor:
        if isinstance(X, torch.Tensor):
            T = X.to(self._dt)
        else:
            T = torch.as_tensor(np.asarray(X, dtype=np.float64 if self.dtype == "float64" else np.float32))
            T = T.to(self._dt)
        if T.dim() == 3:
            T = T.reshape(T.shape[0], -1)
        if T.dim() != 2 or T.shape[1] != self.window_size:
            raise ValueError(
                f"expected windows of {self.window_size} values ((n_his+1)*n_vis = "
                f"({self.n_his}+1)*{self.n_vis}), got shape {tuple(X.shape) if hasattr(X, 'shape') else '?'}"
            )
        if not torch.isfinite(T).all():
            raise ValueError("windows contain NaN or infinite values; normalise them first")
        return T

    def _as_one(self, x: Any) -> torch.Tensor:
        if isinstance(x, dict):
            x = list(x.values())
        return self._as_batch(np.asarray(x, dtype=np.float64).reshape(1, -1))

    def _split(self, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = T / self.sigma
        n_c = self.n_his * self.n_vis
        return T[:, n_c:], T[:, :n_c]

    # ------------------------------------------------------------------ conditionals
    def _hidden(self, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(u @ self.W.T + d @ self.B.T + self.b_h)

    def _visible(self, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return h @ self.W + d @ self.A.T + self.b_v

    # ------------------------------------------------------------------ learning
    def learn_one(self, x: Any) -> None:
        """One CD-k step on one window."""
        self._learn(self._as_one(x))

    def learn_many(self, X: Any) -> None:
        """One CD-k step on the mean gradient of a batch of windows ``(n, window_size)``."""
        T = self._as_batch(X)
        if T.shape[0]:
            self._learn(T)

    def gradients(self, X: Any) -> dict[str, torch.Tensor]:
        """The CD-k gradient estimate (ascent direction) for a batch, without updating.

        Uses the model's generator when ``sample_hidden`` is true.
        """
        with torch.no_grad():
            return self._grads(self._as_batch(X))

    def _grads(self, T: torch.Tensor) -> dict[str, torch.Tensor]:
        u0, d = self._split(T)
        n = T.shape[0]
        h0 = self._hidden(u0, d)
        hs = h0
        uk, hk = u0, h0
        for _ in range(self.k):
            if self.sample_hidden:
                hs = torch.bernoulli(hs, generator=self._gen)
            uk = self._visible(hs, d)
            hk = self._hidden(uk, d)
            hs = hk
        return {
            "W": (h0.T @ u0 - hk.T @ uk) / n,
            "B": (h0.T @ d - hk.T @ d) / n,
            "A": ((u0 - uk).T @ d) / n,
            "b_h": (h0 - hk).mean(0),
            "b_v": (u0 - uk).mean(0),
        }

    def _learn(self, T: torch.Tensor) -> None:
        with torch.no_grad():
            g = self._grads(T)
            for name in self._PARAMS:
                p = getattr(self, name)
                step = g[name]
                if self.weight_decay and name in ("W", "A", "B"):
                    step = step - self.weight_decay * p
                v = self._vel[name]
                v.mul_(self.momentum).add_(step, alpha=self.lr)
                p.add_(v)
        self._n_seen += int(T.shape[0])
        self._n_updates += 1

    # ------------------------------------------------------------------ inference
    def predict_many(self, X: Any) -> np.ndarray:
        """Hidden activation probabilities, shape ``(n, n_hid)``, as numpy."""
        with torch.inference_mode():
            u, d = self._split(self._as_batch(X))
            return self._hidden(u, d).numpy()

    def predict_one(self, x: Any) -> np.ndarray:
        """Hidden activation probabilities of one window, shape ``(n_hid,)``."""
        with torch.inference_mode():
            u, d = self._split(self._as_one(x))
            return self._hidden(u, d)[0].numpy()

    def reconstruct_many(self, X: Any) -> np.ndarray:
        """Mean-field reconstruction of the current frame, in normalised units."""
        with torch.inference_mode():
            u, d = self._split(self._as_batch(X))
            return (self._visible(self._hidden(u, d), d) * self.sigma).numpy()

    def reconstruction_error(self, X: Any) -> float:
        """Mean squared error of :meth:`reconstruct_many` on the current frames."""
        T = self._as_batch(X)
        rec = self.reconstruct_many(T)
        return float(((T[:, -self.n_vis :].numpy() - rec) ** 2).mean())

    def free_energy_many(self, X: Any) -> np.ndarray:
        """Free energy ``F(u | d)`` of each window (scaled units, docs/phases.md, "The model")."""
        with torch.inference_mode():
            u, d = self._split(self._as_batch(X))
            quad = 0.5 * ((u - d @ self.A.T - self.b_v) ** 2).sum(1)
            soft = torch.nn.functional.softplus(u @ self.W.T + d @ self.B.T + self.b_h).sum(1)
            return (quad - soft).numpy()

    # ------------------------------------------------------------------ checkpoint
    def _meta(self) -> dict[str, Any]:
        return {
            "n_vis": self.n_vis,
            "n_hid": self.n_hid,
            "n_his": self.n_his,
            "sigma": self.sigma,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "k": self.k,
            "sample_hidden": self.sample_hidden,
            "init_scale": self.init_scale,
            "dtype": self.dtype,
            "seed": self.seed,
        }

    def to_bytes(self) -> bytes:
        """Versioned checkpoint: parameters, momentum buffers, counters, RNG state."""
        arrays = {name: getattr(self, name).numpy() for name in self._PARAMS}
        arrays.update({f"vel_{name}": self._vel[name].numpy() for name in self._PARAMS})
        arrays["rng"] = self._gen.get_state().numpy()
        meta = {"params": self._meta(), "n_seen": self._n_seen, "n_updates": self._n_updates}
        return pack("CRBM", self.VERSION, meta, arrays)

    @classmethod
    def from_bytes(cls, data: bytes) -> CRBM:
        """Load a checkpoint written by :meth:`to_bytes`; another version raises ``CheckpointError``."""
        meta, arr = unpack(data, "CRBM", cls.VERSION)
        obj = cls(**meta["params"])
        for name in cls._PARAMS:
            setattr(obj, name, torch.from_numpy(arr[name]))
            obj._vel[name] = torch.from_numpy(arr[f"vel_{name}"])
        obj._gen.set_state(torch.from_numpy(arr["rng"]))
        obj._n_seen = int(meta["n_seen"])
        obj._n_updates = int(meta["n_updates"])
        return obj

    def clone(self) -> CRBM:
        """An independent copy (same parameters and RNG state)."""
        return self.from_bytes(self.to_bytes())

    def __getstate__(self) -> dict:
        return {"blob": self.to_bytes()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(self.from_bytes(state["blob"]).__dict__)

    def __repr__(self) -> str:
        return (
            f"CRBM(n_vis={self.n_vis}, n_hid={self.n_hid}, n_his={self.n_his}, sigma={self.sigma}, "
            f"k={self.k}, n_seen={self._n_seen})"
        )

    # convenience for callers holding frames as a sequence
    @staticmethod
    def window(frames: Sequence[Sequence[float]]) -> np.ndarray:
        """Flatten frames (oldest first, current last) into one window vector."""
        return np.asarray(frames, dtype=np.float64).reshape(-1)
