"""The worker's settings as the models' configurations: features, starting model, detector parameters."""

from __future__ import annotations

import pytest

from phasewise.kit.settings import Settings
from phasewise.models.phases.detector import PhaseModel
from phasewise.models.phases.updater import PhaseHooks
from phasewise.streams.config import detector_config, initial_model, recommender_params, state_cache
from tests.models.phases.test_phase_updater import warm_model


def test_phase_features_are_checked_and_pick_the_starting_model():
    from phasewise.kit.settings import SettingsError

    for bad, why in (("cpu,gpu", "must hold cpu,mem"), ("cpu,mem,tpu", "unknown feature"),
                     ("cpu,mem,mem", "twice")):
        with pytest.raises(SettingsError, match=why):
            Settings.from_env({"phase_features": bad}, env={})
    m, origin = initial_model(Settings.from_env({}, env={}))
    assert m.features == ("cpu", "mem") and origin.startswith("pretrained") and m.ready
    m, origin = initial_model(Settings.from_env({"phase_features": "cpu,mem,gpu"}, env={}))
    assert m.features == ("cpu", "mem", "gpu") and origin == "cold" and not m.ready
    with pytest.raises(SettingsError, match="phase_ratio_cap"):
        Settings.from_env({"phase_ratio_cap": -1.0}, env={})
    for cap, want in ((1.5, 1.5), (0.0, float("inf"))):  # 0 = no cap
        s = Settings.from_env({"phase_ratio_cap": cap}, env={})
        assert PhaseHooks(detector_config(s), state_cache(s), model=warm_model()).fleet.ratio_cap == want
    with pytest.raises(ValueError, match="must include"):
        PhaseHooks(detector_config(Settings.from_env({}, env={})), state_cache(Settings.from_env({}, env={})),
                   model=PhaseModel(features=("mem", "gpu")))


def test_the_worker_vpa_defaults_are_the_in_process_vpa_defaults():
    """Replay runs the worker with the VPA settings' defaults and scores it against the in-process
    ``VpaPolicy()``: the two must hold the same parameters (the settings' own are written once)."""
    from phasewise.models.vpa.recommender import VpaRecommender

    params = recommender_params(Settings())
    model = VpaRecommender()
    assert params == {k: getattr(model, k) for k in params}
    assert set(params) == {"time_scale", "min_cpu_cores", "min_mem_bytes", "throttle_threshold",
                           "throttle_bump"}


def test_the_faust_web_server_is_off_unless_a_port_is_set():
    """Faust's web server serves its own views, the tables' contents among them: off on a bare host."""
    from phasewise.streams.app import create_app

    assert Settings.from_env({}, env={}).worker.web_port == 0
    app = create_app(Settings.from_env({}, env={}), register_agents=False)
    assert app.conf.web_enabled is False
    app = create_app(Settings.from_env({"web_port": 6070}, env={}), register_agents=False)
    assert app.conf.web_enabled is True and app.conf.web_port == 6070 and app.conf.web_bind == "127.0.0.1"
