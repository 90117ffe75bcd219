"""A launch told of no cluster starts its own Ray cluster even when another one is recorded on the machine
(igpo/main.py ``pin_own_cluster``). Ray's default ``ray.init()`` joins the cluster named in
``<RAY_TMPDIR>/ray/ray_current_cluster`` (written by ``ray start`` and by ``ray.cluster_utils.Cluster``, e.g. a test
module's cluster beside a training run) and then refuses the presets' ``num_cpus``; the pinned config starts a
private cluster instead. The recorded address here is a dead port in a private RAY_TMPDIR, so nothing else is seen."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from igpo.main import pin_own_cluster

# Builds ray_init from the CPU demo's sizes, pins it or not, and calls ray.init as verl's run_ppo does.
PROBE = """
import json, sys
import ray
from omegaconf import OmegaConf
from igpo.main import pin_own_cluster
config = OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 1, "include_dashboard": False}}})
if sys.argv[1] == "pinned":
    pin_own_cluster(config, {})
try:
    ray.init(**OmegaConf.to_container(config.ray_kwargs.ray_init), logging_level="ERROR")
except ValueError as error:
    print(json.dumps({"error": str(error)}))
else:
    print(json.dumps({"cpus": ray.cluster_resources().get("CPU")}))
    ray.shutdown()
"""


def _ray_init(mode: str, ray_tmpdir: Path) -> dict:
    env = {"PATH": "/usr/bin:/bin", "RAY_TMPDIR": str(ray_tmpdir), "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_recorded_cluster_is_not_joined_once_the_run_is_pinned_to_its_own():
    with tempfile.TemporaryDirectory(prefix="igpo-ray-") as folder:  # short: Ray's socket paths live under it
        (Path(folder) / "ray").mkdir()
        (Path(folder) / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
        # The failure this guards against, reproduced: unpinned, Ray goes for the recorded cluster.
        assert "num_cpus and num_gpus must not be provided" in _ray_init("default", Path(folder)).get("error", "")
        assert _ray_init("pinned", Path(folder)) == {"cpus": 1.0}


def test_a_cluster_named_by_the_user_is_left_alone():
    def pinned(ray_init: dict, environ: dict) -> dict:
        config = OmegaConf.create({"ray_kwargs": {"ray_init": ray_init}})
        pin_own_cluster(config, environ)
        return OmegaConf.to_container(config.ray_kwargs.ray_init)

    assert pinned({"num_cpus": 2}, {}) == {"num_cpus": 2, "address": "local"}
    assert pinned({"num_cpus": None}, {"RAY_ADDRESS": "10.0.0.1:6379"}) == {"num_cpus": None}
    assert pinned({"address": "10.0.0.1:6379"}, {}) == {"address": "10.0.0.1:6379"}
