"""cluster.yaml is a valid Ray cluster-launcher config (checked by Ray's own schema validation)."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_cluster_yaml_validates_with_ray():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    full = prepare_config(cfg)      # merges the provider defaults, as `ray up` does
    validate_config(full)           # Ray's JSON schema + node-type checks
    assert full["head_node_type"] in full["available_node_types"]
    assert any("make setup" in c for c in full["setup_commands"])
    assert "--dashboard-host=127.0.0.1" in " ".join(full["head_start_ray_commands"])


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
    assert args.tensor_parallel_size == 1 and args.max_batch_size >= 1
    with pytest.raises(ValueError):
        ServeArgs.from_dict({**app["args"], "not_a_field": 1})
