"""The names a job spec may use: catalog models, datasets and their input shapes (pure data, no torch).
Names match case-insensitively ignoring ``-``, ``_`` and spaces, and a family name means its usual
member (docs/horus.md, "The catalog").

>>> canonical_model("ResNet-18"), canonical_model("EfficientNet"), canonical_model("LM")
('resnet18', 'efficientnet_b0', 'lstm_lm')
>>> canonical_dataset("Wikitext-2"), dataset_shape("cifar10").image_size
('wikitext2', 32)
>>> canonical_model("cyclegan") is None
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MODELS", "DATASETS", "DatasetShape", "normalise", "canonical_model", "model_key", "canonical_dataset",
           "dataset_shape", "is_entry_point", "default_dataset", "MlpSpec", "parse_mlp", "parse_module_list",
           "entry_point_refusal", "FeatureError"]


class FeatureError(ValueError):
    """The job's graph cannot be built or run; ``str(e)`` says why (a dead letter's reason). Declared here,
    with the names, so that what only reads specs need not import torch (:mod:`.graph_features` uses it)."""


@dataclass(frozen=True, slots=True)
class DatasetShape:
    """The input one sample of a dataset gives a model."""

    name: str
    kind: str  #: image | tokens | seq2seq | ratings | points | state | noise
    channels: int = 0
    image_size: int = 0
    seq_len: int = 0
    vocab: int = 0
    tgt_vocab: int = 0
    classes: int = 0
    users: int = 0
    items: int = 0
    points: int = 0
    state_dim: int = 0
    action_dim: int = 0


#: dataset -> shape (sizes as the datasets' usual training set-ups use them)
DATASETS: dict[str, DatasetShape] = {
    d.name: d for d in (
        DatasetShape("cifar10", "image", channels=3, image_size=32, classes=10),
        DatasetShape("imagenet", "image", channels=3, image_size=224, classes=1000),
        DatasetShape("lsun", "image", channels=3, image_size=64, classes=10),  # DCGAN's 64x64 bedrooms
        DatasetShape("squad", "tokens", seq_len=384, vocab=30522, classes=2),  # BERT's max_seq_length 384
        DatasetShape("wikitext2", "tokens", seq_len=35, vocab=33278),  # bptt 35, the word-level vocabulary
        DatasetShape("multi30k", "seq2seq", seq_len=32, vocab=7853, tgt_vocab=5893),  # de -> en
        DatasetShape("movielens", "ratings", users=6040, items=3706),  # ML-1M, NeuMF's set-up
        DatasetShape("shapenet", "points", points=2048, classes=16),
        DatasetShape("lunarlander", "state", state_dim=8, action_dim=4),
        DatasetShape("bipedalwalker", "state", state_dim=24, action_dim=4),
        DatasetShape("vectors", "state"),  # random feature vectors; their width is the model's input width
    )
}

_DATASET_ALIASES = {"cifar": "cifar10", "ilsvrc2012": "imagenet", "imagenet1k": "imagenet", "ml1m": "movielens",
                    "wikitext": "wikitext2", "lunarlanderv2": "lunarlander", "bipedalwalkerv3": "bipedalwalker",
                    "squad11": "squad", "squadv11": "squad", "lsunbedroom": "lsun"}

#: catalog model -> the dataset it is usually trained on
MODELS: dict[str, str] = {
    "resnet18": "cifar10",
    "resnet50": "imagenet",
    "vgg16": "cifar10",
    "vgg19": "cifar10",
    "mobilenet_v2": "cifar10",
    "mobilenet_v3": "cifar10",
    "efficientnet_b0": "imagenet",
    "bert_base": "squad",
    "lstm_lm": "wikitext2",
    "transformer": "multi30k",
    "dcgan": "lsun",
    "neumf": "movielens",
    "pointnet": "shapenet",
    "ppo_mlp": "lunarlander",
    "td3_mlp": "bipedalwalker",
}

_MODEL_ALIASES = {
    "resnet": "resnet50", "vgg": "vgg16", "mobilenet": "mobilenet_v2", "mobilenetv3large": "mobilenet_v3",
    "mobilenetv3small": "mobilenet_v3", "efficientnet": "efficientnet_b0", "bert": "bert_base",
    "bertbaseuncased": "bert_base", "lstm": "lstm_lm", "lm": "lstm_lm", "languagemodel": "lstm_lm",
    "transformerbase": "transformer", "seq2seqtransformer": "transformer", "ppo": "ppo_mlp", "td3": "td3_mlp",
    "ncf": "neumf",
}

_DROP = re.compile(r"[-_\s]+")
#: the MLP family: ``mlp-IN x H1 x ... x OUT`` then optional ``-ACTIVATION``, ``-bn``, ``-dropout``
_MLP = re.compile(r"^mlp[-_ ]?(\d{1,6}(?:x\d{1,6}){1,64})((?:[-_ +][a-z]+)*)$", re.IGNORECASE)
#: activations an MLP name may use (torch.nn class names, matched case-insensitively)
MLP_ACTIVATIONS = ("ReLU", "Tanh", "Sigmoid", "Softplus", "PReLU", "Mish", "SiLU", "Identity", "ELU", "SELU",
                   "LeakyReLU", "GELU")


@dataclass(frozen=True, slots=True)
class MlpSpec:
    """A plain MLP: layer widths (input first), activation, batch norm and dropout after each hidden layer."""

    widths: tuple[int, ...]
    activation: str = "ReLU"
    batchnorm: bool = False
    dropout: bool = False

    @property
    def name(self) -> str:
        extra = "".join(f"-{x}" for x, on in (("bn", self.batchnorm), ("dropout", self.dropout)) if on)
        return f"mlp-{'x'.join(map(str, self.widths))}-{self.activation.lower()}{extra}"


def parse_mlp(name: str) -> MlpSpec | None:
    """The MLP an ``mlp-...`` name describes, or None.

    >>> parse_mlp("MLP-784x256x10-GELU-bn").name
    'mlp-784x256x10-gelu-bn'
    """
    m = _MLP.match(name.strip())
    if m is None:
        return None
    widths = tuple(int(w) for w in m.group(1).lower().split("x"))
    if min(widths) < 1:
        return None
    act, bn, drop = "ReLU", False, False
    acts = {a.lower(): a for a in MLP_ACTIVATIONS}
    for tok in re.split(r"[-_ +]", m.group(2).lower())[1:]:
        if tok == "bn":
            bn = True
        elif tok == "dropout":
            drop = True
        elif tok in acts:
            act = acts[tok]
        else:
            return None
    return MlpSpec(widths, act, bn, drop)


def normalise(name: str) -> str:
    """Lower case without ``-``, ``_`` and spaces."""
    return _DROP.sub("", name).lower()


_MODEL_KEYS = {normalise(m): m for m in MODELS} | {k: v for k, v in _MODEL_ALIASES.items()}
_DATASET_KEYS = {normalise(d): d for d in DATASETS} | dict(_DATASET_ALIASES)


def is_entry_point(name: str) -> bool:
    """``module:function`` (a user model) rather than a catalog name."""
    mod, sep, fn = name.partition(":")
    return bool(sep) and bool(mod) and bool(fn) and all(p.isidentifier() for p in mod.split(".")) \
        and fn.isidentifier()


def parse_module_list(text: str) -> tuple[str, ...]:
    """The modules of a comma list (``horus_model_modules``), stripped, empties dropped.

    >>> parse_module_list(" mypkg.models, other ,")
    ('mypkg.models', 'other')
    """
    return tuple(m for m in (x.strip() for x in text.split(",")) if m)


def entry_point_refusal(name: str, allowed: tuple[str, ...]) -> str | None:
    """Why ``module:function`` *name* may not be imported under the allowlist *allowed*, or None when it may.

    A listed module allows itself and its submodules (``mypkg`` allows
    ``mypkg.models``); nothing else is imported, however it is spelled.

    >>> entry_point_refusal("mypkg.models:build", ("mypkg",)) is None
    True
    >>> entry_point_refusal("os:abort", ()).split(";")[0]
    'module os is not in horus_model_modules (empty: catalog models only)'
    >>> entry_point_refusal("mypkgx:build", ("mypkg",)).split(";")[0]
    'module mypkgx is not in horus_model_modules (mypkg)'
    """
    mod = name.partition(":")[0]
    if any(mod == m or mod.startswith(m + ".") for m in allowed):
        return None
    listed = ", ".join(allowed) if allowed else "empty: catalog models only"
    return (f"module {mod} is not in horus_model_modules ({listed}); an operator lists the modules whose "
            f"module:function models horus imports")


def canonical_model(name: str) -> str | None:
    """The catalog model *name* means (an MLP's canonical ``mlp-...`` name), or None."""
    mlp = parse_mlp(name) if name[:3].lower() == "mlp" else None
    return mlp.name if mlp is not None else _MODEL_KEYS.get(normalise(name))


def model_key(name: str) -> str:
    """The name jobs of this model share (catalog canonical name, or the entry point as given)."""
    return canonical_model(name) or name


def canonical_dataset(name: str) -> str | None:
    """The catalog dataset *name* means, or None."""
    return _DATASET_KEYS.get(normalise(name))


def dataset_shape(name: str) -> DatasetShape:
    """The shape of dataset *name*; ``KeyError`` with the known names when it is none."""
    key = canonical_dataset(name)
    if key is None:
        raise KeyError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    return DATASETS[key]


def default_dataset(model: str) -> str | None:
    key = canonical_model(model)
    return None if key is None else MODELS.get(key, "vectors")
