"""cluster.yaml is a valid Ray cluster-launcher config (checked by Ray's own schema validation)."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_validates_with_ray():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    full = prepare_config(cfg)      # merges the provider defaults, as `ray up` does
    validate_config(full)           # Ray's JSON schema + node-type checks
    assert full["head_node_type"] in full["available_node_types"]
    assert any("make setup" in c for c in full["setup_commands"])
    assert "--dashboard-host=127.0.0.1" in " ".join(full["head_start_ray_commands"])
    # the head's autoscaler loads the AWS node provider from the venv Ray starts from: without
    # boto3 there it cannot launch a worker, and the head runs nothing itself (--num-cpus=0)
    assert full["provider"]["type"] == "aws"
    assert any("boto3" in c and ".venv/bin/python -m pip install" in c
               for c in full["head_setup_commands"])


def test_cluster_yaml_rejects_a_broken_copy():
    pytest.importorskip("jsonschema")
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    cfg["available_node_types"]["head"]["bogus_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(cfg))


def test_serve_default_yaml_args_are_valid():
    from deployments.config import ServeArgs

    cfg = yaml.safe_load((ROOT / "deployments" / "serve_default.yaml").read_text())
    app = cfg["applications"][0]
    assert app["import_path"] == "deployments.openai_app:build_app"
    args = ServeArgs.from_dict(app["args"])
    assert args.tensor_parallel_size == 1 and args.engine.max_batch_size >= 1
    with pytest.raises(ValueError):
        ServeArgs.from_dict({**app["args"], "not_a_field": 1})


def test_head_node_runs_no_workloads():
    """The head starts with 0 CPUs: replicas, TP ranks and batch actors only land on workers."""
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert "--num-cpus=0" in " ".join(cfg["head_start_ray_commands"])


def test_deployment_placement_spread_and_strict_pack(monkeypatch):
    monkeypatch.setenv("DART_RAY_ALLOCATOR", "system")   # placement only (allocator: below)
    from deployments.config import ServeArgs
    from deployments.placement import deployment_placement, spread_options

    # TP = 1: replicas spread, at most max_replicas_per_node per node (none: Serve's soft SPREAD)
    assert deployment_placement({"num_cpus": 0.5}) == {"ray_actor_options": {"num_cpus": 0.5}}
    assert deployment_placement({"num_cpus": 0.5, "max_replicas_per_node": 1}) == {
        "ray_actor_options": {"num_cpus": 0.5}, "max_replicas_per_node": 1}
    # TP = N: one STRICT_PACK group per replica (all ranks on one node); the replica fits bundle 0
    tp = deployment_placement({"tensor_parallel_size": 2, "device": "cuda", "num_cpus": 4})
    assert tp["placement_group_strategy"] == "STRICT_PACK"
    assert tp["placement_group_bundles"] == [{"CPU": 4.0, "GPU": 1.0}] * 2
    assert tp["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 1.0}
    assert "max_replicas_per_node" not in tp
    assert deployment_placement({"tensor_parallel_size": 2, "placement_strategy": "PACK"})[
        "placement_group_strategy"] == "PACK"
    # a ServeArgs works as well as a dict (fields it lacks take the defaults)
    args = ServeArgs(tensor_parallel_size=2, num_cpus=1)
    assert deployment_placement(args)["placement_group_bundles"] == [{"CPU": 1.0}] * 2
    with pytest.raises(ValueError, match="cannot be combined"):
        deployment_placement({"tensor_parallel_size": 2, "max_replicas_per_node": 1})
    with pytest.raises(ValueError, match="unknown placement strategy"):
        deployment_placement({"tensor_parallel_size": 2, "placement_strategy": "RANDOM"})
    with pytest.raises(ValueError, match="unknown placement strategy"):
        deployment_placement({"placement_strategy": "RANDOM"})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_replicas_per_node"):
            spread_options(bad)
    assert spread_options(None) == {}


def test_cpu_replicas_start_under_the_fast_allocator(monkeypatch):
    """A CPU replica's actor gets the allocator variables (a process-start setting, see
    dart_ray.allocator) through its runtime_env; a GPU replica is left as it is."""
    from dart_ray import actor_allocator_env
    from deployments.placement import deployment_placement

    for k in ("LD_PRELOAD", "MALLOC_CONF", "GLIBC_TUNABLES", "DART_RAY_ALLOCATOR"):
        monkeypatch.delenv(k, raising=False)
    want = actor_allocator_env()
    opts = deployment_placement({"num_cpus": 0.5})["ray_actor_options"]
    if want:
        assert opts["runtime_env"] == {"env_vars": want}
        assert "LD_PRELOAD" in want or "GLIBC_TUNABLES" in want
    gpu = deployment_placement({"num_cpus": 1, "device": "cuda"})["ray_actor_options"]
    assert "runtime_env" not in gpu
    monkeypatch.setenv("DART_RAY_ALLOCATOR", "system")
    assert "runtime_env" not in deployment_placement({"num_cpus": 0.5})["ray_actor_options"]
