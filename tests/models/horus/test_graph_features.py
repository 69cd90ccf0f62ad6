"""Graph features from real models on the meta device, against hand counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phasewise.models.horus.catalog import DatasetShape, canonical_dataset, canonical_model
from phasewise.models.horus.graph_features import FeatureError, catalog_features, features

VEC = DatasetShape("vec", "state", state_dim=10, action_dim=2)
IMG = DatasetShape("img", "image", channels=3, image_size=8)


def test_an_mlp_counts_as_by_hand():
    f = features(lambda: nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 2)), name="mlp", shape=VEC,
                 batch=4, amp=False, optimizer="adam")
    # forward 2*4*10*5 + 2*4*5*2 = 480; backward: grad W2 80, grad input of layer 2 80, grad W1 400 (the
    # input needs no gradient)
    assert f.flops == 480 + 80 + 80 + 400
    assert (f.params, f.param_bytes, f.optimizer_bytes) == (67, 268, 536)
    # saved for backward: the batch (4x10 floats) and the ReLU output (4x5), which Linear 2 shares
    assert f.activation_bytes == 4 * 10 * 4 + 4 * 5 * 4
    assert (f.linear, f.conv, f.depth, f.input_elements) == (2, 0, 2, 10)
    assert f.train_mem_bytes == 2 * 268 + 536 + 240


def test_a_conv_block_counts_as_by_hand_and_amp_halves_activations():
    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    f = features(build, name="c", shape=IMG, batch=1, amp=False)
    macs = 8 * 8 * 8 * 3 * 9  # out positions x out channels x (in channels x kernel)
    assert f.flops == 2 * macs * 2  # forward + weight gradient (no input gradient)
    assert (f.conv, f.norm, f.params) == (1, 1, 8 * 27 + 8 + 16)
    # at least: conv input (3x8x8), conv output kept by batch norm (8x8x8), ReLU output (8x8x8)
    assert 4 * (192 + 512 + 512) <= f.activation_bytes <= 4 * (192 + 512 + 512) + 256
    g = features(build, name="c", shape=IMG, batch=1, amp=True)
    assert g.activation_bytes == f.activation_bytes // 2 and g.flops == f.flops


def test_catalog_models_match_their_reference_sizes_and_flops():
    r18 = catalog_features("ResNet-18", "ImageNet", 32, False)
    assert r18.params == 11_689_512  # torchvision resnet18
    assert (r18.conv, r18.linear, r18.norm) == (20, 1, 20)
    # 1.82 GMAC forward per 224x224 image (He et al.), backward twice that: ~10.9 GFLOP per image
    assert 10.5e9 * 32 < r18.flops < 11.2e9 * 32
    assert catalog_features("resnet50", "imagenet", 1, False).params == 25_557_032
    assert catalog_features("mobilenet_v3", "imagenet", 1, False).params == 5_483_032  # mobilenet_v3_large
    assert catalog_features("efficientnet", "imagenet", 1, False).params == 5_288_548
    lm = catalog_features("LSTM", "Wikitext-2", 20, False)
    assert (lm.recurrent, lm.embedding, lm.linear) == (2, 1, 1) and lm.seq_len == 35
    tr = catalog_features("transformer", "multi30k", 8, False)
    assert tr.attention == 18  # 6 encoder self, 6 decoder self, 6 decoder cross
    assert catalog_features("resnet18", "cifar10", 64, False).flops > catalog_features(
        "resnet18", "cifar10", 32, False).flops


class _Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase], layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.rnn = kind(10, 6, layers, bidirectional=bidirectional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_a_recurrent_layer_launches_what_cudnn_fuses_it_into_not_its_unrolled_operators(kind):
    steps = 7  # VEC's batch of 7 is an unbatched sequence of 7 steps to a recurrent layer

    def kernels(layers: int, bidirectional: bool) -> int:
        return features(lambda: _Recurrent(kind, layers, bidirectional), name="r", shape=VEC, batch=steps,
                        amp=False).kernels

    # per layer and direction: a recurrent GEMM and a fused pointwise kernel per step, forward and backward,
    # the input GEMM forward and backward and three weight and bias gradients; nothing else changes
    per = 4 * steps + 5
    assert kernels(2, False) - kernels(1, False) == per
    assert kernels(1, True) - kernels(1, False) == per
    assert kernels(3, True) - kernels(1, True) == 2 * 2 * per
    # unrolled, the meta device dispatches several times as many operators per step
    lm = catalog_features("lstm_lm", "wikitext2", 20, False)
    assert lm.kernels < 2 * 2 * (4 * 35 + 5) + 40


def test_features_are_cached_per_canonical_name():
    from phasewise.models.horus.graph_features import _catalog_features

    first = catalog_features("vgg16", "cifar10", 128, True)
    before = _catalog_features.cache_info()
    again = catalog_features("VGG", "CIFAR-10", 128, True)  # another spelling of the same entry
    after = _catalog_features.cache_info()
    assert again is first and (after.hits, after.misses) == (before.hits + 1, before.misses)


@pytest.mark.parametrize("call, reason", [
    (lambda: catalog_features("resnet18", "squad", 8, False), "takes image input; dataset squad gives tokens"),
    (lambda: catalog_features("alexnet", "cifar10", 8, False), "unknown model 'alexnet'"),
    (lambda: catalog_features("resnet18", "mnist", 8, False), "unknown dataset 'mnist'"),
    (lambda: catalog_features("vgg16", "imagenet", 2**20, False), "TiB for one step"),
    (lambda: features(lambda: 1 / 0, name="bad", shape=VEC, batch=1, amp=False), "ZeroDivisionError"),
    (lambda: features(lambda: nn.Linear(3, 2), name="bad", shape=VEC, batch=1, amp=False), "failed on a batch"),
])
def test_bad_specs_raise_a_feature_error_with_the_reason(call, reason):
    with pytest.raises(FeatureError) as e:
        call()
    assert reason in str(e.value)


def test_names_normalise():
    assert canonical_model("Mobile Net_V2") == "mobilenet_v2" and canonical_model("VGG") == "vgg16"
    assert canonical_dataset("Multi-30k") == "multi30k" and canonical_model("Transformer") == "transformer"
    assert torch.empty(0).device.type == "cpu"  # nothing leaked the meta device into the default
