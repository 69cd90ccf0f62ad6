"""The catalog's models as real ``torch.nn.Module`` builders, sized by the dataset they train on
(:class:`~phasewise.models.horus.catalog.DatasetShape`), after the reference implementations the
cluster studies ran; built under ``torch.device("meta")`` they give shapes without weights
(:mod:`phasewise.models.horus.graph_features`). The catalog: docs/horus.md, "The catalog".

>>> import torch
>>> from phasewise.models.horus.catalog import DATASETS
>>> with torch.device("meta"):
...     m = build("resnet18", DATASETS["cifar10"])
>>> sum(p.numel() for p in m.parameters())
11173962
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from phasewise.models.horus.catalog import DatasetShape, MlpSpec, parse_mlp

__all__ = ["build", "BUILDERS", "INPUT_KIND", "OPTIMIZER"]

# --------------------------------------------------------------------------- ResNet


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.short = nn.Sequential()
        if stride != 1 or cin != planes:
            self.short = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.short = nn.Sequential()
        if stride != 1 or cin != out:
            self.short = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], classes: int, small: bool) -> None:
        super().__init__()
        if small:  # CIFAR: 3x3 stem, no max-pool
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                      nn.MaxPool2d(3, 2, 1))
        cin, stages = 64, []
        for i, n in enumerate(layers):
            planes = 64 * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, planes, 2 if (i > 0 and j == 0) else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# --------------------------------------------------------------------------- VGG

_VGG = {16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
        19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]}


class VGG(nn.Module):
    def __init__(self, depth: int, classes: int, small: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in _VGG[depth]:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.BatchNorm2d(int(v)), nn.ReLU()]
                cin = int(v)
        self.features = nn.Sequential(*layers)
        if small:  # CIFAR VGG: 512 -> classes
            self.pool = nn.Identity()
            self.classifier = nn.Linear(512, classes)
        else:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.classifier = nn.Sequential(nn.Linear(512 * 49, 4096), nn.ReLU(), nn.Dropout(),
                                            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


# --------------------------------------------------------------------------- MobileNet V2 / V3, EfficientNet-B0


def _div(v: float, d: int = 8) -> int:
    """*v* rounded to a multiple of *d*, never more than 10 % down (torchvision's _make_divisible)."""
    out = max(d, int(v + d / 2) // d * d)
    return out + d if out < 0.9 * v else out


class _SE(nn.Module):
    def __init__(self, c: int, squeeze: int, gate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1), gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc1(nn.functional.adaptive_avg_pool2d(x, 1))
        # EfficientNet squeezes through SiLU and gates with a sigmoid; MobileNetV3 uses ReLU, hard sigmoid
        s = nn.functional.silu(s) if self.gate is torch.sigmoid else torch.relu(s)
        return x * self.gate(self.fc2(s))


class _Inverted(nn.Module):
    """An inverted residual (MBConv): expand 1x1, depthwise kxk, optional squeeze-excite, project 1x1."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, expand: float, act: type,
                 se: int = 0, se_gate: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid) -> None:
        super().__init__()
        mid = _div(cin * expand) if expand != 1 else cin
        layers: list[nn.Module] = []
        if mid != cin:
            layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), act()]
        layers += [nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), act()]
        if se:
            layers.append(_SE(mid, se, se_gate))
        layers += [nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class _ConvNet(nn.Module):
    def __init__(self, stem: int, blocks: list[nn.Module], cin: int, head: int, classes: int, act: type,
                 stride: int, hidden: int = 0) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 3, stride, 1, bias=False), nn.BatchNorm2d(stem), act())
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(cin, head, 1, bias=False), nn.BatchNorm2d(head), act())
        if hidden:
            self.classifier = nn.Sequential(nn.Linear(head, hidden), act(), nn.Dropout(0.2),
                                            nn.Linear(hidden, classes))
        else:
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(head, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def mobilenet_v2(classes: int, small: bool) -> nn.Module:
    cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    blocks, cin = [], 32
    for i, (t, c, n, s) in enumerate(cfg):
        for j in range(n):
            stride = s if j == 0 and not (small and i == 1) else 1  # CIFAR: keep 32x32 one stage longer
            blocks.append(_Inverted(cin, c, 3, stride, t, nn.ReLU6))
            cin = c
    return _ConvNet(32, blocks, cin, 1280, classes, nn.ReLU6, 1 if small else 2)


def mobilenet_v3(classes: int, small: bool) -> nn.Module:
    """MobileNetV3-Large."""
    hs, re = nn.Hardswish, nn.ReLU
    cfg = [(3, 16, 16, False, re, 1), (3, 64, 24, False, re, 2), (3, 72, 24, False, re, 1),
           (5, 72, 40, True, re, 2), (5, 120, 40, True, re, 1), (5, 120, 40, True, re, 1),
           (3, 240, 80, False, hs, 2), (3, 200, 80, False, hs, 1), (3, 184, 80, False, hs, 1),
           (3, 184, 80, False, hs, 1), (3, 480, 112, True, hs, 1), (3, 672, 112, True, hs, 1),
           (5, 672, 160, True, hs, 2), (5, 960, 160, True, hs, 1), (5, 960, 160, True, hs, 1)]
    blocks, cin = [], 16
    for i, (k, exp, c, se, act, s) in enumerate(cfg):
        stride = 1 if small and i == 1 else s
        blocks.append(_Inverted(cin, c, k, stride, exp / cin, act, _div(exp / 4) if se else 0,
                                nn.functional.hardsigmoid))
        cin = c
    return _ConvNet(16, blocks, cin, 960, classes, hs, 1 if small else 2, hidden=1280)


def efficientnet_b0(classes: int, small: bool) -> nn.Module:
    cfg = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
           (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
    blocks, cin = [], 32
    for i, (t, k, s, c, n) in enumerate(cfg):
        for j in range(n):
            stride = s if j == 0 and not (small and i == 1) else 1
            blocks.append(_Inverted(cin, c, k, stride, t, nn.SiLU, max(1, cin // 4), torch.sigmoid))
            cin = c
    return _ConvNet(32, blocks, cin, 1280, classes, nn.SiLU, 1 if small else 2)


# --------------------------------------------------------------------------- language


class BertEncoder(nn.Module):
    """BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072; a span (start/end) head as for SQuAD."""

    def __init__(self, d: DatasetShape, hidden: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(d.vocab, hidden)
        self.pos = nn.Embedding(512, hidden)
        self.typ = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.qa = nn.Linear(hidden, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.norm(self.tok(ids) + self.pos(pos) + self.typ(torch.zeros_like(ids)))
        return self.qa(self.encoder(x))


class LstmLM(nn.Module):
    """PyTorch's word_language_model, LSTM: emsize 200, nhid 200, 2 layers, dropout 0.2 (the Gavel LM)."""

    def __init__(self, d: DatasetShape, emsize: int = 200, nhid: int = 200, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(d.vocab, emsize)
        self.rnn = nn.LSTM(emsize, nhid, layers, dropout=0.2, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(nhid, d.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.encoder(ids)))
        return self.decoder(self.drop(out))


class Seq2SeqTransformer(nn.Module):
    """The base Transformer (d_model 512, 8 heads, 6+6 layers, FFN 2048), Multi30k vocabularies."""

    def __init__(self, d: DatasetShape, dm: int = 512, heads: int = 8, layers: int = 6) -> None:
        super().__init__()
        self.src = nn.Embedding(d.vocab, dm)
        self.tgt = nn.Embedding(d.tgt_vocab, dm)
        self.pos = nn.Embedding(256, dm)
        self.core = nn.Transformer(dm, heads, layers, layers, 4 * dm, batch_first=True)
        self.generator = nn.Linear(dm, d.tgt_vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(src.shape[1], device=src.device)).unsqueeze(0)
        q = self.pos(torch.arange(tgt.shape[1], device=tgt.device)).unsqueeze(0)
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.generator(self.core(self.src(src) + p, self.tgt(tgt) + q, tgt_mask=mask, tgt_is_causal=True))


# --------------------------------------------------------------------------- GAN, recommendation, points, RL


class DCGAN(nn.Module):
    """DCGAN (Radford et al.) for 64x64 images: nz 100, ngf = ndf = 64; a step = D on real and fake, then G."""

    def __init__(self, d: DatasetShape, nz: int = 100, ngf: int = 64, ndf: int = 64) -> None:
        super().__init__()
        self.nz = nz
        c = d.channels
        self.G = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, c, 4, 2, 1, bias=False), nn.Tanh())
        self.D = nn.Sequential(
            nn.Conv2d(c, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, real: torch.Tensor) -> torch.Tensor:
        z = torch.zeros(real.shape[0], self.nz, 1, 1, device=real.device, dtype=real.dtype)
        fake = self.G(z)
        return self.D(real).sum() + self.D(fake.detach()).sum() + self.D(fake).sum()


class NeuMF(nn.Module):
    """NeuMF (He et al. 2017): GMF with 8 factors + MLP with 32-dim embeddings and layers 64-32-16-8."""

    def __init__(self, d: DatasetShape, factors: int = 8, layers: tuple[int, ...] = (64, 32, 16, 8)) -> None:
        super().__init__()
        self.gmf_u, self.gmf_i = nn.Embedding(d.users, factors), nn.Embedding(d.items, factors)
        self.mlp_u, self.mlp_i = nn.Embedding(d.users, layers[0] // 2), nn.Embedding(d.items, layers[0] // 2)
        mlp: list[nn.Module] = []
        for a, b in zip(layers, layers[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*mlp)
        self.out = nn.Linear(factors + layers[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        g = self.gmf_u(users) * self.gmf_i(items)
        m = self.mlp(torch.cat([self.mlp_u(users), self.mlp_i(items)], -1))
        return torch.sigmoid(self.out(torch.cat([g, m], -1)))


class _TNet(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                  nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024), nn.ReLU())
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, k * k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.fc(torch.amax(self.conv(x), 2)).view(-1, self.k, self.k)
        return t + torch.eye(self.k, device=x.device, dtype=x.dtype)


class PointNet(nn.Module):
    """PointNet classification (Qi et al. 2017) with the input and feature T-nets."""

    def __init__(self, d: DatasetShape) -> None:
        super().__init__()
        self.t3, self.t64 = _TNet(3), _TNet(64)
        self.conv1 = nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                   nn.Conv1d(128, 1024, 1), nn.BatchNorm1d(1024))
        self.fc = nn.Sequential(nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                nn.Linear(512, 256), nn.Dropout(0.3), nn.BatchNorm1d(256), nn.ReLU(),
                                nn.Linear(256, d.classes))

    def forward(self, pts: torch.Tensor) -> torch.Tensor:
        x = torch.bmm(self.t3(pts).transpose(1, 2), pts)
        x = self.conv1(x)
        x = torch.bmm(self.t64(x).transpose(1, 2), x)
        return self.fc(torch.amax(self.conv2(x), 2))


def _mlp(sizes: list[int], act: type) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


class PPOPolicy(nn.Module):
    """PPO's actor and critic, two hidden layers of 64 with tanh (the Stable-Baselines3 default)."""

    def __init__(self, d: DatasetShape) -> None:
        super().__init__()
        self.pi = _mlp([d.state_dim, 64, 64, d.action_dim], nn.Tanh)
        self.vf = _mlp([d.state_dim, 64, 64, 1], nn.Tanh)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.pi(obs).sum() + self.vf(obs).sum()


class TD3Policy(nn.Module):
    """TD3 (Fujimoto et al. 2018): actor 400-300, twin critics 400-300."""

    def __init__(self, d: DatasetShape) -> None:
        super().__init__()
        self.actor = _mlp([d.state_dim, 400, 300, d.action_dim], nn.ReLU)
        self.q1 = _mlp([d.state_dim + d.action_dim, 400, 300, 1], nn.ReLU)
        self.q2 = _mlp([d.state_dim + d.action_dim, 400, 300, 1], nn.ReLU)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.actor(obs))
        sa = torch.cat([obs, a], 1)
        return self.q1(sa).sum() + self.q2(sa).sum()


# --------------------------------------------------------------------------- the table


def _vision(make: Callable[[int, bool], nn.Module]) -> Callable[[DatasetShape], nn.Module]:
    return lambda d: make(d.classes, d.image_size <= 64)


#: catalog model -> builder(dataset shape) -> module
BUILDERS: dict[str, Callable[[DatasetShape], nn.Module]] = {
    "resnet18": _vision(lambda c, s: ResNet(_Basic, [2, 2, 2, 2], c, s)),
    "resnet50": _vision(lambda c, s: ResNet(_Bottleneck, [3, 4, 6, 3], c, s)),
    "vgg16": _vision(lambda c, s: VGG(16, c, s)),
    "vgg19": _vision(lambda c, s: VGG(19, c, s)),
    "mobilenet_v2": _vision(mobilenet_v2),
    "mobilenet_v3": _vision(mobilenet_v3),
    "efficientnet_b0": _vision(efficientnet_b0),
    "bert_base": BertEncoder,
    "lstm_lm": LstmLM,
    "transformer": Seq2SeqTransformer,
    "dcgan": DCGAN,
    "neumf": NeuMF,
    "pointnet": PointNet,
    "ppo_mlp": PPOPolicy,
    "td3_mlp": TD3Policy,
}

#: catalog model -> the dataset kind its forward takes
INPUT_KIND: dict[str, str] = {
    **{m: "image" for m in ("resnet18", "resnet50", "vgg16", "vgg19", "mobilenet_v2", "mobilenet_v3",
                            "efficientnet_b0", "dcgan")},
    "bert_base": "tokens", "lstm_lm": "tokens", "transformer": "seq2seq", "neumf": "ratings",
    "pointnet": "points", "ppo_mlp": "state", "td3_mlp": "state",
}

#: catalog model -> the optimizer its reference training uses (state bytes per parameter byte)
OPTIMIZER: dict[str, str] = {
    **{m: "sgd_momentum" for m in ("resnet18", "resnet50", "vgg16", "vgg19", "mobilenet_v2", "mobilenet_v3",
                                   "efficientnet_b0", "lstm_lm")},
    **{m: "adam" for m in ("bert_base", "transformer", "dcgan", "neumf", "pointnet", "ppo_mlp", "td3_mlp")},
}


def mlp(spec: MlpSpec) -> nn.Module:
    """A plain MLP: Linear, [BatchNorm1d], activation, [Dropout] per hidden layer, then Linear."""
    layers: list[nn.Module] = []
    w = spec.widths
    for i, (a, b) in enumerate(zip(w, w[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(w) - 2:
            if spec.batchnorm:
                layers.append(nn.BatchNorm1d(b))
            layers.append(getattr(nn, spec.activation)())
            if spec.dropout:
                layers.append(nn.Dropout(0.2))
    return nn.Sequential(*layers)


def build(name: str, shape: DatasetShape) -> nn.Module:
    """The catalog model *name* (canonical) sized for dataset *shape*."""
    spec = parse_mlp(name)
    if spec is not None:
        return mlp(spec)
    return BUILDERS[name](shape)


def input_kind(name: str) -> str:
    return "state" if parse_mlp(name) is not None else INPUT_KIND[name]


def optimizer(name: str) -> str:
    return "adam" if parse_mlp(name) is not None else OPTIMIZER[name]
