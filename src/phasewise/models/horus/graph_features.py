"""Graph features of a training job, from its real model, without weights or activations: the model
built on PyTorch's ``meta`` device runs one training step under ``FlopCounterMode`` and a saved-tensor
hook, giving the step's FLOPs, parameters, activation and optimizer bytes, layer counts and an
estimate of its training memory (:class:`GraphFeatures`). Narrative: docs/horus.md, "Graph features".

>>> from phasewise.models.horus.catalog import DATASETS
>>> f = catalog_features("ppo_mlp", "lunarlander", 64, False)
>>> f.params, f.linear, f.depth
(9797, 6, 6)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from phasewise.models.horus.catalog import (
    DATASETS,
    MODELS,
    DatasetShape,
    FeatureError,
    canonical_dataset,
    canonical_model,
    parse_mlp,
)

__all__ = ["GraphFeatures", "FeatureError", "features", "catalog_features", "inputs_for", "MAX_STEP_BYTES"]

#: a step needing more memory than this (2 TiB) is an absurd spec, not a job
MAX_STEP_BYTES = 2 * 2**40
#: optimizer state bytes per parameter byte
OPTIMIZER_STATE = {"sgd": 0.0, "sgd_momentum": 1.0, "adam": 2.0}


@dataclass(frozen=True, slots=True)
class GraphFeatures:
    """What a training step of a model computes and keeps (per step of one batch)."""

    model: str
    dataset: str
    batch_size: int
    amp: bool
    flops: int  #: FLOPs of one training step (forward + backward), as FlopCounterMode counts them
    params: int
    param_bytes: int
    activation_bytes: int  #: bytes saved for backward
    optimizer_bytes: int
    conv: int
    linear: int
    recurrent: int
    attention: int
    norm: int
    embedding: int
    depth: int  #: weight layers: conv + linear + recurrent layers + attention blocks
    seq_len: int
    image_size: int
    input_elements: int  #: elements of one sample's input
    kernels: int = 0  #: operators a training step runs that launch work (forward, backward), views left out

    @property
    def step_kernels(self) -> int:
        """:attr:`kernels`, or where unknown (features from before it was counted) an estimate from the layers:
        about 3 forward and 6 backward operators per weight layer, 4 and 8 per norm layer."""
        return self.kernels or 9 * self.depth + 12 * self.norm + 8

    @property
    def train_mem_bytes(self) -> int:
        """Parameters, their gradients, optimizer state and activations."""
        return 2 * self.param_bytes + self.optimizer_bytes + self.activation_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["train_mem_bytes"] = self.train_mem_bytes
        return d


def inputs_for(kind: str, shape: DatasetShape, batch: int, device: str = "meta") -> tuple[torch.Tensor, ...]:
    """One batch of dataset *shape* as a model taking *kind* inputs sees it."""
    if kind != shape.kind and not (kind == "image" and shape.kind == "image"):
        raise FeatureError(f"the model takes {kind} input; dataset {shape.name} gives {shape.kind}")
    long = dict(dtype=torch.long, device=device)
    if kind == "image":
        return (torch.zeros(batch, shape.channels, shape.image_size, shape.image_size, device=device),)
    if kind == "tokens":
        return (torch.zeros(batch, shape.seq_len, **long),)
    if kind == "seq2seq":
        return torch.zeros(batch, shape.seq_len, **long), torch.zeros(batch, shape.seq_len, **long)
    if kind == "ratings":
        return torch.zeros(batch, **long), torch.zeros(batch, **long)
    if kind == "points":
        return (torch.zeros(batch, 3, shape.points, device=device),)
    if kind == "state":
        return (torch.zeros(batch, shape.state_dim, device=device),)
    raise FeatureError(f"no input of kind {kind!r}")


def _layer_counts(model: nn.Module) -> dict[str, int]:
    c = dict(conv=0, linear=0, recurrent=0, attention=0, norm=0, embedding=0)
    inside_attention: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            c["attention"] += 1
            inside_attention.update(id(x) for x in m.modules())
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            c["conv"] += 1
        elif isinstance(m, nn.Linear) and id(m) not in inside_attention:
            c["linear"] += 1
        elif isinstance(m, nn.RNNBase):
            c["recurrent"] += m.num_layers
        elif isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
            c["norm"] += 1
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            c["embedding"] += 1
    return c


#: operators that launch no kernel (metadata and allocation only)
_NO_KERNEL = {"detach", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "_to_copy_meta", "alias", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand", "view",
              "_unsafe_view", "reshape", "slice", "select", "as_strided", "split", "chunk", "unbind", "flatten",
              "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "is_same_size", "numel", "dim"}


class _KernelCount(TorchDispatchMode):
    """Counts the operators dispatched that would launch a kernel on a GPU (views and allocations left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _NO_KERNEL and not func.is_view:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _fused_rnn_kernels(m: nn.RNNBase, steps: int) -> int:
    """Kernels one forward and backward of recurrent module *m* over *steps* time steps launches as cuDNN's
    standard algorithm runs it: per layer and direction, a recurrent GEMM and one fused pointwise kernel per
    step, forward and backward (``4 * steps``), the input GEMM forward and backward and the gradients of the
    input and recurrent weights and of the bias (5)."""
    return m.num_layers * (2 if m.bidirectional else 1) * (4 * steps + 5)


def _rnn_kernels(calls: list[tuple[nn.RNNBase, torch.Tensor]]) -> int:
    """How many fewer kernels than counted the recurrent modules' *calls* launch: the meta device runs them
    unrolled (an LSTM step is a dozen operators forward and twice as many backward), a GPU fused
    (:func:`_fused_rnn_kernels`). Each call's unrolled count is taken again alone on its own input."""
    fewer = 0
    for m, x in calls:
        steps = x.shape[1 if m.batch_first else 0] if x.dim() == 3 else x.shape[0]
        grads = [(p, p.grad) for p in m.parameters()]
        for p, _ in grads:
            p.grad = None  # the step's gradients: accumulating into them would be counted as more operators
        inp = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            try:
                with _KernelCount() as alone:
                    out = m(inp)[0]
                    if out.requires_grad:
                        torch.autograd.backward(out, torch.zeros_like(out))
            finally:
                for p, g in grads:
                    p.grad = g
        fewer += max(0, alone.n - _fused_rnn_kernels(m, int(steps)))
    return fewer


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def features(build: Callable[[], nn.Module], *, name: str, shape: DatasetShape, batch: int, amp: bool,
             input_kind: str | None = None, optimizer: str = "adam") -> GraphFeatures:
    """The graph features of one training step of ``build()`` on a batch of *shape*.

    *build* is called under ``torch.device("meta")``; any exception it or
    the step raises becomes a :class:`FeatureError` naming it.
    """
    if batch < 1:
        raise FeatureError(f"batch size {batch} is not positive")
    kind = input_kind or shape.kind
    inputs = inputs_for(kind, shape, batch)
    try:
        with torch.device("meta"):
            model = build()
    except Exception as e:  # user code: whatever it raises is the reason
        raise FeatureError(f"model {name} failed to build: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise FeatureError(f"model {name} is not a torch.nn.Module (got {type(model).__name__})")
    model.train()
    params = list(model.parameters())
    rnn_calls: list[tuple[nn.RNNBase, torch.Tensor]] = []  # (module, its input) for each recurrent module's call
    hooks = [m.register_forward_pre_hook(
        lambda mod, args: rnn_calls.append((mod, args[0])) if args and isinstance(args[0], torch.Tensor) else None)
        for m in model.modules() if isinstance(m, nn.RNNBase)]
    param_keys = {_storage_key(p) for p in params}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "meta":
            key = _storage_key(t)
            if key not in param_keys and key not in saved:
                size = t.untyped_storage().nbytes()
                if amp and t.is_floating_point():
                    size //= max(1, t.element_size() // 2)
                saved[key] = size
        return t

    try:
        with (FlopCounterMode(display=False) as counter, _KernelCount() as kernels,
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            out = model(*inputs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            losses = [o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
            if not losses:
                raise FeatureError(f"model {name} returned no floating-point tensor to train on")
            loss = functools.reduce(torch.add, losses)
            if loss.requires_grad:
                loss.backward()
        fewer = _rnn_kernels(list(rnn_calls))  # (its own calls of the modules add to rnn_calls, not to the list)
    except FeatureError:
        raise
    except Exception as e:  # a shape error in user code, an op without a meta kernel
        raise FeatureError(f"model {name} failed on a batch of {batch} from {shape.name}: "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    finally:
        for h in hooks:
            h.remove()
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    counts = _layer_counts(model)
    sample = inputs[0][0]
    f = GraphFeatures(
        model=name, dataset=shape.name, batch_size=batch, amp=amp, flops=int(counter.get_total_flops()),
        params=n_params, param_bytes=param_bytes, activation_bytes=sum(saved.values()),
        optimizer_bytes=int(OPTIMIZER_STATE.get(optimizer, 2.0) * param_bytes), **counts,
        depth=counts["conv"] + counts["linear"] + counts["recurrent"] + counts["attention"],
        seq_len=shape.seq_len, image_size=shape.image_size, input_elements=math.prod(sample.shape) or 1,
        kernels=max(1, kernels.n - fewer),
    )
    if f.train_mem_bytes > MAX_STEP_BYTES:
        raise FeatureError(f"batch size {batch} of {name} on {shape.name} needs about "
                           f"{f.train_mem_bytes / 2**40:.1f} TiB for one step: not a job any device runs")
    return f


def catalog_features(model: str, dataset: str, batch: int, amp: bool) -> GraphFeatures:
    """:func:`features` of a catalog model (any spelling the catalog accepts), cached per canonical names."""
    key = canonical_model(model)
    if key is None:
        raise FeatureError(f"unknown model {model!r} (catalog: {', '.join(MODELS)})")
    ds = canonical_dataset(dataset)
    if ds is None:
        raise FeatureError(f"unknown dataset {dataset!r} (known: {', '.join(DATASETS)})")
    return _catalog_features(key, ds, int(batch), bool(amp))


@functools.lru_cache(maxsize=1024)
def _catalog_features(key: str, ds: str, batch: int, amp: bool) -> GraphFeatures:
    from phasewise.models.horus import zoo as horus_zoo

    shape = DATASETS[ds]
    mlp = parse_mlp(key)
    if mlp is not None and shape.kind == "state":  # the vectors are as wide as the MLP's input
        shape = dataclasses.replace(shape, state_dim=mlp.widths[0])
    return features(lambda: horus_zoo.build(key, shape), name=key, shape=shape, batch=batch, amp=amp,
                    input_kind=horus_zoo.input_kind(key), optimizer=horus_zoo.optimizer(key))
