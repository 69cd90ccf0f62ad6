"""Job specs naming ``module:function``, and hostile nested specs: a reason every time, never a crash.

A ``module:function`` is built only when its module is allowed (``horus_model_modules``), in a child process.
"""

from __future__ import annotations

import json

import pytest

from phasewise.kit.records import JobEvent, JobSpec, SchemaError, decode
from phasewise.models.horus.graph_features import FeatureError
from phasewise.streams.horus_jobs import BuildRules, spec_features

MODULE = '''
from torch import nn

def good():
    return nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))

def broken():
    raise RuntimeError("no weights file")

def not_a_module():
    return 42

def wrong_width():
    return nn.Linear(7, 2)
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    name = f"pw_user_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def allowing(*modules: str) -> BuildRules:
    return BuildRules(modules, timeout_s=60.0)


def test_an_entry_point_is_imported_built_on_meta_and_measured(user_models):
    f = spec_features(JobSpec(model=f"{user_models}:good", dataset="BipedalWalker", batch_size=8),
                      allowing(user_models))
    assert (f.linear, f.params) == (2, 24 * 16 + 16 + 16 * 4 + 4)
    assert f.flops == 2 * 8 * (24 * 16 + 16 * 4) + 2 * 8 * 16 * 4 + 2 * 8 * 24 * 16 + 2 * 8 * 16 * 4


@pytest.mark.parametrize("model, dataset, reason", [
    ("{m}:missing", "bipedalwalker", "has no callable 'missing'"),
    ("pw_no_such_module_xyz:build", "bipedalwalker", "cannot import pw_no_such_module_xyz: ModuleNotFoundError"),
    ("{m}:broken", "bipedalwalker", "failed to build: RuntimeError: no weights file"),
    ("{m}:not_a_module", "bipedalwalker", "is not a torch.nn.Module"),
    ("{m}:wrong_width", "bipedalwalker", "failed on a batch of 8 from bipedalwalker"),
    ("{m}:good", "cifar100", "unknown dataset 'cifar100'"),
    ("resnet-181", "cifar10", "unknown model 'resnet-181'"),
])
def test_bad_entry_points_say_why(user_models, model, dataset, reason):
    with pytest.raises(FeatureError) as e:
        spec_features(JobSpec(model=model.format(m=user_models), dataset=dataset, batch_size=8),
                      allowing(user_models, "pw_no_such_module_xyz"))
    assert reason in str(e.value)


@pytest.mark.parametrize("model", ["{m}:good", "os:abort", "this:x", "logging:disable", "{m}x:good"])
def test_a_module_not_allowed_is_never_imported(user_models, model):
    """Default (catalog only), or a list without the module: refused with the reason, nothing imported."""
    import sys

    name = model.format(m=user_models)
    for rules in (None, BuildRules(), allowing("pw_other")):
        with pytest.raises(FeatureError, match=r"is not in horus_model_modules"):
            spec_features(JobSpec(model=name, dataset="bipedalwalker", batch_size=8), rules)
    assert user_models not in sys.modules and "this" not in sys.modules


@pytest.mark.parametrize("spec", [
    [], "resnet", {"model": ["x"], "dataset": "cifar10", "batch_size": 1},
    {"model": "x", "dataset": "cifar10", "batch_size": True},
    {"model": "x", "dataset": "cifar10", "batch_size": 1, "requests": "lots"},
    {"model": "x", "dataset": "cifar10", "batch_size": 1, "requests": {"gpus": float("inf")}},
    {"model": "x", "dataset": "cifar10", "batch_size": 1, "command": [["python"]]},
    {"model": "x", "dataset": "cifar10", "batch_size": 1, "targets": {"acceptable": "low"}},
    {"model": "x", "dataset": "cifar10", "batch_size": 10**30},
])
def test_hostile_nested_specs_are_schema_errors(spec):
    raw = json.dumps({"v": 1, "job": "j", "ts": 1, "kind": "submitted", "spec": spec}).encode()
    with pytest.raises(SchemaError, match="^JobEvent: spec"):
        decode(JobEvent, raw)
    # (10,000 deep: 50 kB, under the job event's 64 KiB, so that the parser's depth is what refuses it)
    deep = b'{"v":1,"job":"j","ts":1,"kind":"submitted","spec":' + b"{\"a\":" * 10_000 + b"1" + b"}" * 10_001
    with pytest.raises(SchemaError, match="nested too deeply"):
        decode(JobEvent, deep)
