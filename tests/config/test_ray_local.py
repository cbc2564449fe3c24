"""dart_ray.init_ray: a Ray it starts is new, local, and runs its workers at nice 0; a cluster
named by address or RAY_ADDRESS is joined as it is (ray.init is faked here;
tests/batch/test_batch.py starts a real one through it)."""

from __future__ import annotations

import pytest

from dart_ray import init_ray


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    calls: list[dict] = []
    state = {"up": False}

    def fake_init(**kw):
        calls.append(kw)
        kw.get("_system_config", {})["added_by_ray"] = True      # ray.init mutates its config
        state["up"] = True

    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls, state


def test_a_new_local_ray_runs_its_workers_unniced(fake_ray):
    calls, state = fake_ray
    assert init_ray(num_cpus=2, _system_config={"object_spilling_threshold": 0.9}) is True
    assert calls[-1]["num_cpus"] == 2 and calls[-1]["address"] == "local"   # not a running one
    assert calls[-1]["_system_config"] == {"worker_niceness": 0, "object_spilling_threshold": 0.9,
                                           "added_by_ray": True}
    state["up"] = False
    init_ray(_system_config={"worker_niceness": 5})               # the caller's entries win
    assert calls[-1]["_system_config"] == {"worker_niceness": 5, "added_by_ray": True}
    state["up"] = False
    init_ray(address="local")
    assert calls[-1]["_system_config"] == {"worker_niceness": 0, "added_by_ray": True}
    assert init_ray() is False and len(calls) == 3                # already up: nothing called


def test_a_named_cluster_is_joined_with_its_own_settings(fake_ray, monkeypatch):
    calls, state = fake_ray
    init_ray(address="ray://head:10001", include_dashboard=False)
    assert calls == [{"address": "ray://head:10001", "include_dashboard": False}]
    state["up"] = False
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")            # a Ray job's driver
    init_ray(include_dashboard=False)
    assert calls[-1] == {"include_dashboard": False}              # ray.init joins RAY_ADDRESS
