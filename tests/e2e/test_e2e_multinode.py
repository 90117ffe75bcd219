"""Multi-node rehearsal on one machine: a two-node Ray cluster (`ray start --head` + `ray start --address=...`, one
fake GPU each), `bash train_igpo.sh` joining it through RAY_ADDRESS with trainer.nnodes=2, two CPU training steps,
without TOOL_SERVER_URL: the launcher's tool server must be reached from both nodes (the per-node /health check
before the models load, then the tool calls of the agent-loop workers on each node). The same run is the two-rank
check: two FSDP2 ranks (one per node) shard the actor-side answer scoring in lockstep, their scores match the
rollout's, and the rollout serves the actor's weights after an update. A second run on the same kind of cluster puts
``igpo_separate_async``'s standalone rollout on the node the trainer does not use: the weights cross nodes at every
sync, and the receiving node checks their version and the sender's fingerprint.

The nodes are private to the test: own temp dir, own ports, token authentication off (RAY_AUTH_MODE=disabled: Ray
2.60 turns it on for new clusters, and no one else joins this one). Each `ray start --block` runs in its own process
group, which is killed at the end, pass or fail: `ray stop` would stop every Ray cluster of the machine.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from guarded_run import REPO, SEARCHING_DEMO, run_guarded

pytestmark = pytest.mark.e2e

RAY = str(Path(sys.executable).parent / "ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_args(worker_ports: tuple[int, int]) -> list[str]:
    """Ports two nodes of one host would otherwise share (each node runs its own agents and workers)."""
    return ["--node-ip-address=127.0.0.1", "--num-cpus=8", "--num-gpus=1", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
            f"--min-worker-port={worker_ports[0]}", f"--max-worker-port={worker_ports[1]}", "--block"]


def _alive_nodes(address: str, env: dict) -> int:
    probe = "import ray; ray.init(address=%r, logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    result = subprocess.run([sys.executable, "-c", probe % address], env=env, capture_output=True, text=True,
                            timeout=60)
    return int(result.stdout.split()[-1]) if result.returncode == 0 and result.stdout.split() else 0


def _start_nodes(temp_dir: str, env: dict, nodes: list) -> str:
    """Start the head and the second node (appended to ``nodes``, each in its own process group, its output in
    ``<temp_dir>/ray_start_<i>.log``); return the cluster's address once both are alive. An AssertionError carries
    the tail of the output of a `ray start` that exited."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    logs = [Path(temp_dir) / f"ray_start_{i}.log" for i in range(2)]
    commands = [
        [RAY, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
         f"--ray-client-server-port={_free_port()}", *_node_args((20000, 20999))],
        [RAY, "start", f"--address={address}", f"--temp-dir={temp_dir}/n2", *_node_args((21000, 21999))],
    ]
    for command, log in zip(commands, logs):
        with log.open("w") as out:
            nodes.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        if len(nodes) == 1:
            time.sleep(5)
    deadline = time.monotonic() + 90
    while _alive_nodes(address, env) < 2:
        for node, log in zip(nodes, logs):
            assert node.poll() is None, f"a `ray start` exited ({node.args[1:3]}):\n{log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "the two-node cluster did not come up in 90 s"
        time.sleep(2)
    return address


def _kill_nodes(nodes: list, temp_dir: str) -> None:
    for node in reversed(nodes):
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()
    # Workers, agents and the GCS all belong to the two groups: nothing of the cluster may outlive the test.
    for _ in range(20):  # killed processes leave the table once reaped
        left = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"processes of the test cluster survived: {left}"
    nodes.clear()


@pytest.fixture
def two_node_cluster():
    # Short (Ray's socket paths must stay under 107 bytes), and one per node as on separate machines: nodes sharing a
    # session folder would each forward the other's worker logs to the driver, printing every line twice.
    temp_dir = tempfile.mkdtemp(prefix="igpo-ray-")
    # Every worker process inherits the node's environment: the CPU backend is chosen there (VERL_PLATFORM), not by
    # the driver, whose environment does not travel to an existing cluster.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "VERL_PLATFORM": "cpu", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    nodes: list = []
    try:
        # The ports are picked free, then bound by `ray start` a moment later: on a busy machine another process can
        # take one in between, and that `ray start` exits. That is the test's setup failing, not the product: one
        # more try on fresh ports, the first try's output kept in the error if the second fails too.
        try:
            address = _start_nodes(temp_dir, env, nodes)
        except AssertionError as first:
            _kill_nodes(nodes, temp_dir)
            try:
                address = _start_nodes(temp_dir, env, nodes)
            except AssertionError as second:
                raise AssertionError(f"{second}\n(first try: {first})") from None
        yield address, env
    finally:
        _kill_nodes(nodes, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_two_nodes_one_actor_rank_each_with_our_plugin(tmp_path, two_node_cluster):
    address, cluster_env = two_node_cluster
    env = {**cluster_env, "RAY_ADDRESS": address, "NNODES": "2", "OUTPUT_DIR": str(tmp_path / "run"), "IGPO_DEVICE": "cpu"}
    env.pop("TOOL_SERVER_URL", None)
    # Two agent-loop workers (the demo runs one), which verl places round-robin: one per node, each sending tool calls;
    # 64 trajectories a step, so that each node's half holds searches (the demo model searches in ~1 of 5). The two
    # FSDP2 ranks (gloo, fp32) score on the actor beside the rollout's own scores (score_on=rollout + verify_scoring),
    # so this run also checks that the ranks shard the answer scoring in lockstep and agree with the rollout side.
    rc, out = run_guarded(["bash", "train_igpo.sh", *SEARCHING_DEMO, "trainer.total_training_steps=2",
                           "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                           "actor_rollout_ref.rollout.agent.num_workers=2",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                           "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           "algorithm.igpo.score_on=rollout", "algorithm.igpo.verify_scoring=true",
                           # verl's warm-up starts at lr 0: the first update would leave the policy where it was.
                           "actor_rollout_ref.actor.optim.lr_warmup_steps=0"], env, timeout=900)
    assert rc == 0, out[-4000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"joining the Ray cluster at RAY_ADDRESS={address}" in out
    assert "Connecting to existing Ray cluster" in log, "the trainer started its own Ray instead of joining"
    # One actor rank per node, each running our worker class (the report method exists only there).
    placement = re.search(r"igpo: actor ranks on Ray nodes (\[.*?\]) \((\d) distinct\)", log)
    assert placement and len(json.loads(placement.group(1))) == 2 and placement.group(2) == "2", log[-3000:]
    # The plugin ran in the remote processes: the igpo_agent loop (registered on import by the plugin) produced
    # turns, and the actor ranks on both nodes scored answers for IGPO's information gain.
    assert "igpo: step:1" in out and "igpo: step:2" in out, out[-3000:]
    turns = [float(v) for v in re.findall(r"igpo/turns_mean:([0-9.eE+-]+)", log)]
    # Every trajectory has at least one turn and no more than the demo's max_turns (4): the loop ran, within its bound.
    assert len(turns) == 2 and all(1 <= t <= 4 for t in turns), turns
    tokens = [float(v) for v in re.findall(r"igpo/scoring_tokens:([0-9.eE+-]+)", log)]
    assert len(tokens) == 2 and min(tokens) > 0, tokens
    assert [float(v) for v in re.findall(r"igpo/scoring_errors:([0-9.eE+-]+)", log)] == [0.0, 0.0]
    # The launcher's own tool server (no TOOL_SERVER_URL): before the models load, a task on each node reached its
    # /health; then the agent-loop workers on both nodes sent tool calls, and none failed for infrastructure reasons.
    nodes = json.loads(placement.group(1))
    reach = re.search(r"igpo: tool server at (http://\S+) reachable from every Ray node \(2: (.*)\)", log)
    assert reach and all(node[:8] in reach.group(2) for node in nodes), log[-3000:]
    workers = re.search(r"igpo: \d+ agent-loop workers on Ray nodes (\[.*?\]) \(2 distinct\)", log)
    assert workers and sorted(json.loads(workers.group(1))) == sorted(set(nodes)), log[-3000:]
    by_node = re.findall(r"igpo: tool calls by Ray node so far: (.*)", log)
    assert len(by_node) == 2, log[-3000:]
    calls = re.findall(r"(\S+) ([0-9a-f]{8}): (\d+) \(infra_error (\d+)\)", by_node[-1])
    assert sorted(node for _, node, _, _ in calls) == sorted(n[:8] for n in nodes), by_node[-1]
    assert all(int(n) > 0 and int(infra) == 0 for _, _, n, infra in calls), by_node[-1]
    assert [float(v) for v in re.findall(r"igpo/infra_errors:([0-9.eE+-]+)", log)] == [0.0, 0.0]
    # Two ranks scoring in lockstep, each its share: the actor's answer log-probs match the rollout's at both steps.
    agreement = [float(v) for v in re.findall(r"igpo/scoring_rollout_vs_actor_max_abs_diff:([0-9.eE+-]+|nan)", log)]
    assert len(agreement) == 2 and max(agreement) <= 1e-4, agreement
    # Weights really reach the rollout server: rollout and actor log-probs of sampled tokens agree at step 2 too.
    diffs = [float(v) for v in re.findall(r"training/rollout_probs_diff_max:([0-9.eE+-]+)", log)]
    assert len(diffs) == 2 and max(diffs) < 1e-3, diffs
    # The policy changed: at step 1 the actor is the reference policy (KL 0); after one update it is not.
    kl = [float(v) for v in re.findall(r"actor/kl_loss:([0-9.eE+-]+)", log)]
    assert len(kl) == 2 and kl[1] > max(kl[0], 0.0), kl
    adv = [float(v) for v in re.findall(r"igpo/adv_abs_mean:([0-9.eE+-]+)", log)]
    assert len(adv) == 2 and min(adv) > 0, adv
    # The TensorBoard events are where the launcher said, though the cluster's workers did not inherit its environment.
    assert list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*")), "no TensorBoard events in the run"


def test_the_standalone_rollout_on_a_node_of_its_own(tmp_path, two_node_cluster):
    """``igpo_separate_async`` over the two nodes: the trainer's pool (one actor rank) takes one node's only "GPU"
    and the standalone rollout's pool the other's, so every weight sync crosses nodes through the CPU checkpoint
    engine, and the rollout's node checks the version and the sender's fingerprint of what it loads."""
    address, cluster_env = two_node_cluster
    env = {**cluster_env, "RAY_ADDRESS": address, "NNODES": "2", "OUTPUT_DIR": str(tmp_path / "run"),
           "IGPO_DEVICE": "cpu"}
    env.pop("TOOL_SERVER_URL", None)
    steps = 3
    rc, out = run_guarded(["bash", "train_igpo.sh", *SEARCHING_DEMO, f"trainer.total_training_steps={steps}",
                           "trainer.v1.trainer_mode=igpo_separate_async",
                           "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
                           "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                           "actor_rollout_ref.actor.optim.lr_warmup_steps=0"], env, timeout=900)
    assert rc == 0, out[-4000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Connecting to existing Ray cluster" in log, "the trainer started its own Ray instead of joining"
    placement = re.search(r"igpo: actor ranks on Ray nodes (\[.*?\]) \((\d) distinct\)", log)
    assert placement, log[-3000:]
    actor_nodes = json.loads(placement.group(1))
    assert len(actor_nodes) == 1, actor_nodes
    # Every weight version the rollout loaded came from the actor's node to the other one, intact.
    loads = re.findall(r"igpo: weight version (\d+) loaded on Ray node ([0-9a-f]{8}) from Ray node ([0-9a-f]{8}) "
                       r"\((\d+) tensors, fingerprint", log)
    assert loads, log[-3000:]
    versions = sorted({int(version) for version, *_ in loads})
    assert versions[-1] >= steps - 1 and len(versions) >= steps - 1, loads
    assert all(sender == actor_nodes[0][:8] and receiver != sender for _, receiver, sender, _ in loads), loads
    assert "the weights changed on the way" not in log
    # IGPO's signal at every step: answers scored on the actor, advantages made.
    for key in ("igpo/scoring_tokens", "igpo/ig_applied", "igpo/adv_abs_mean"):
        values = [float(v) for v in re.findall(rf"{key}:([0-9.eE+-]+)", log)]
        assert len(values) == steps and min(values) > 0, (key, values)
    assert [float(v) for v in re.findall(r"igpo/scoring_errors:([0-9.eE+-]+)", log)] == [0.0] * steps
    # Off-policy as the mode is: trained trajectories sampled by older weights after the first step.
    staleness = [float(v) for v in
                 re.findall(r"training/off_policy/trajectory_staleness/mean:(?:np\.float64\()?([0-9.eE+-]+)", log)]
    assert len(staleness) == steps and min(staleness[1:]) >= 1, staleness
