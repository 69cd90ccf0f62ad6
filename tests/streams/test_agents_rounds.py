"""How the samples agent groups a batch of messages into steps (``streams.agents.rounds``)."""

from phasewise.kit.records import ContainerSample, HostSamples
from phasewise.streams.agents.samples import Activity, rounds, run_rounds


def m(host: str) -> tuple[str, HostSamples]:
    return host, HostSamples(host=host, ts=1.0, interval_s=1.0,
                             containers=(ContainerSample(container="c", cpu_cores=0.1, mem_bytes=1.0),))


def hosts(runs):
    return [[e for e, _ in run] for run in runs]


def test_a_repeated_host_starts_a_new_step_so_its_ticks_are_learned_in_order():
    got = rounds([m("a"), m("b"), m("a"), m("c"), m("b"), m("b")])
    assert hosts(got) == [["a", "b"], ["a", "c", "b"], ["b"]]


def test_hosts_with_a_slash_are_stepped_alone():
    # "x/y" + "c" and "x" + "y/c" would both be the key "x/y/c"
    got = rounds([m("a"), m("x/y"), m("b"), m("c"), m("x"), m("d/e")])
    assert hosts(got) == [["a"], ["x/y"], ["b", "c", "x"], ["d/e"]]


def test_nothing_in_nothing_out():
    assert rounds([]) == []


def test_samples_read_again_are_stepped_a_round_per_model_version_each_after_using_it():
    version = {"a": 1, "b": 1, "c": 2, "d": 2, "e": 1}  # the model version each message was decided with
    items = [m(h) for h in "abcde"]
    assert hosts(rounds(items, lambda it: version[it[0]])) == [["a", "b"], ["c", "d"], ["e"]]
    used, stepped = [], []
    failed = run_rounds(items, lambda msgs: stepped.append((used[-1], [x.host for x in msgs])) or [],
                        lambda ds: None, lambda it: version[it[0]], used.append)
    assert not failed and stepped == [(1, ["a", "b"]), (2, ["c", "d"]), (1, ["e"])]


def test_a_failing_round_is_stepped_again_message_by_message_and_only_the_bad_one_is_returned():
    steps, emitted = [], []

    def step(msgs):
        steps.append([m.host for m in msgs])
        if any(m.host == "bad" for m in msgs):
            raise RuntimeError("boom")
        return [f"decision:{m.host}" for m in msgs]

    items = [m("a"), m("bad"), m("c"), m("a")]
    failed = run_rounds(items, step, emitted.extend)
    assert [(e, str(err)) for e, err in failed] == [("bad", "boom")]
    assert steps == [["a", "bad", "c"], ["a"], ["bad"], ["c"], ["a"]]
    assert emitted == ["decision:a", "decision:c", "decision:a"]  # message order kept


def test_a_failing_single_message_round_is_returned_once():
    failed = run_rounds([m("bad")], lambda msgs: (_ for _ in ()).throw(ValueError("no")), lambda ds: None)
    assert [(e, type(err).__name__) for e, err in failed] == [("bad", "ValueError")]


def test_the_activity_summary_comes_once_per_interval_and_counts_since_the_last_one():
    now = [0.0]
    a = Activity(60.0, clock=lambda: now[0])
    assert a.tick(3, 300, 300) is None
    a.decisions += 7
    now[0] = 61.0
    assert a.tick(2, 200, 310) == ("last 61 s: 5 messages, 500 container samples, 7 decisions; "
                                   "310 containers tracked")
    now[0] = 90.0
    assert a.tick(1, 100, 310) is None and (a.messages, a.samples, a.decisions) == (1, 100, 0)
