"""dart_ray.init_ray: a Ray it starts is new, local, and does not nice its workers; a cluster
named by address or RAY_ADDRESS is joined as it is (ray.init is faked here;
tests/batch/test_batch.py starts a real one through it)."""

from __future__ import annotations

import copy

import pytest

from dart_ray import init_ray, joins_cluster


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    calls: list[dict] = []         # each call's arguments as ray.init received them
    given: list[dict] = []         # ... and the objects themselves
    state = {"up": False}

    def fake_init(**kw):
        calls.append(copy.deepcopy(kw))
        given.append(kw)
        kw.get("_system_config", {})["added_by_ray"] = True      # ray.init mutates its config
        state["up"] = True

    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls, given, state


def test_a_new_local_ray_does_not_nice_its_workers(fake_ray):
    calls, given, state = fake_ray
    mine = {"object_spilling_threshold": 0.9}
    assert init_ray(num_cpus=2, _system_config=mine) is True
    assert calls[-1]["num_cpus"] == 2 and calls[-1]["address"] == "local"   # not a running one
    assert calls[-1]["_system_config"] == {"worker_niceness": 0, "object_spilling_threshold": 0.9}
    assert mine == {"object_spilling_threshold": 0.9}             # the caller's dict untouched
    for _ in range(2):                                            # a fresh config every time
        state["up"] = False
        assert init_ray() is True
        assert calls[-1]["_system_config"] == {"worker_niceness": 0}
    assert given[-1]["_system_config"] is not given[-2]["_system_config"]
    state["up"] = False
    init_ray(_system_config={"worker_niceness": 5})               # the caller's entries win
    assert calls[-1]["_system_config"] == {"worker_niceness": 5}
    assert init_ray() is False and len(calls) == 4                # already up: nothing called


@pytest.mark.parametrize("env", ["", "local"])
def test_an_empty_or_local_ray_address_starts_a_local_ray(fake_ray, monkeypatch, env):
    calls, _, _ = fake_ray
    monkeypatch.setenv("RAY_ADDRESS", env)
    assert not joins_cluster(None) and not joins_cluster("local")
    assert init_ray(num_cpus=2) is True
    assert calls[-1]["address"] == "local" and calls[-1]["_system_config"]["worker_niceness"] == 0


def test_a_named_cluster_is_joined_with_its_own_settings(fake_ray, monkeypatch):
    calls, _, state = fake_ray
    assert init_ray(address="ray://head:10001", include_dashboard=False) is True
    assert calls == [{"address": "ray://head:10001", "include_dashboard": False}]
    state["up"] = False
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")            # a Ray job's driver
    assert joins_cluster(None) and init_ray(include_dashboard=False) is True
    assert calls[-1] == {"include_dashboard": False}              # ray.init joins RAY_ADDRESS


def test_local_settings_for_a_joined_cluster_fail_loudly(fake_ray, monkeypatch):
    calls, _, _ = fake_ray
    with pytest.raises(ValueError, match="num_cpus set for a new local Ray, but auto joins"):
        init_ray(address="auto", num_cpus=2)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ValueError, match="_system_config set .* RAY_ADDRESS=10.0.0.1:6379 joins"):
        init_ray(_system_config={"worker_niceness": 0})
    assert calls == []
