"""Architecture families of the catalog's models, for scoring the Horus model on families it has not seen
(``phasewise predict eval --by-family`` and ``--leave-family-out``; docs/horus.md, "Across architectures").

>>> family("resnet50"), family("mlp-784x256x10-gelu"), family("ppo_mlp"), family("mylab.nets:wide")
('resnet', 'mlp', 'rl-mlp', 'mylab.nets:wide')
"""

from __future__ import annotations

from phasewise.models.horus.catalog import parse_mlp

__all__ = ["FAMILIES", "family"]

#: catalog model -> its architecture family
FAMILIES: dict[str, str] = {
    "resnet18": "resnet", "resnet50": "resnet",
    "vgg16": "vgg", "vgg19": "vgg",
    "mobilenet_v2": "mobile-cnn", "mobilenet_v3": "mobile-cnn", "efficientnet_b0": "mobile-cnn",
    "bert_base": "transformer", "transformer": "transformer",
    "lstm_lm": "rnn",
    "dcgan": "gan",
    "neumf": "recommender",
    "pointnet": "point-cloud",
    "ppo_mlp": "rl-mlp", "td3_mlp": "rl-mlp",
}


def family(model: str) -> str:
    """The family of canonical model name *model*: a catalog family, ``mlp`` for any ``mlp-...``, else the name
    itself (a ``module:function`` is a family of its own)."""
    if model in FAMILIES:
        return FAMILIES[model]
    return "mlp" if parse_mlp(model) is not None else model
