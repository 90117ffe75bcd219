"""The CPU checkpoint engine (igpo/cpu/checkpoint_engine.py) driven through verl's contract, on a local Ray: each
engine lives in its own Ray actor, as in a run (actor rank 0 sends, another actor rank only drains its generator, two
rollout workers receive), and the calls come in the order verl's CheckpointEngineManager makes them."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import ray
import torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from igpo.cpu.checkpoint_engine import BACKEND, Fingerprint, ObjectStoreCheckpointEngine, WeightSyncError
from igpo.cpu.hf_rollout import SERVER_NAME, HFRolloutServer, HFServerAdapter
from igpo.launch.launch_plan import CPU_CHECKPOINT_ENGINE, CPU_CHECKPOINT_MODULE


@ray.remote(num_cpus=0)
class _Host:
    """One process's checkpoint engine."""

    def __init__(self, **kwargs):
        self.engine = ObjectStoreCheckpointEngine(**kwargs)

    def call(self, method, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def send(self, weights, version, fail_after=None):
        def generate():
            for number, item in enumerate(weights.items()):
                if number == fail_after:
                    raise RuntimeError("gather failed")
                yield item

        return await self.engine.send_weights(generate(), global_steps=version)

    async def receive(self, version):
        return [(name, tensor) async for name, tensor in self.engine.receive_weights(global_steps=version)]

    async def load_into_server(self, version, replica_rank):
        """What verl's CheckpointEngineWorker.update_weights does in a standalone replica's worker."""
        adapter = HFServerAdapter(SimpleNamespace(tensor_model_parallel_size=1, data_parallel_size=1), None, None,
                                  replica_rank=replica_rank)
        await adapter.update_weights(self.engine.receive_weights(global_steps=version), global_steps=version)


@pytest.fixture(scope="module")
def local_ray():
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # a private cluster; ~/.ray/auth_token of a demo run must not matter
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()
        mp.undo()


@pytest.fixture(scope="module")
def hosts(local_ray):
    bucket = 256  # bytes: the weights below take several buckets, and one tensor is larger than a bucket
    senders = [_Host.remote(bucket_size=bucket, is_master=True), _Host.remote(bucket_size=bucket)]
    receivers = [_Host.remote(bucket_size=bucket), _Host.remote(bucket_size=bucket)]
    return senders, receivers


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=generator),  # 512 bytes > one bucket
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 8, generator=generator, dtype=torch.float64),
            "model.norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
            "lm_head.bias": torch.arange(5)}


def _outcome(ref):
    """The call's result, or the exception it raised (Ray's error, an instance of the remote exception's class)."""
    try:
        return ray.get(ref)
    except Exception as error:  # noqa: BLE001 - the tests look at each side's error
        return error


def _sync(senders, receivers, weights, version, asked=None, fail_after=None):
    """One weight sync as CheckpointEngineManager.update_weights runs it; returns each sender's and each receiver's
    result or error."""
    metadata = ray.get([h.call.remote("prepare") for h in senders + receivers])
    to_senders, to_receivers = ObjectStoreCheckpointEngine.build_topology(len(senders), len(receivers), metadata)
    ray.get([h.call.remote("init_process_group", **{k: v[i] for k, v in to_senders.items()})
             for i, h in enumerate(senders)]
            + [h.call.remote("init_process_group", **{k: v[i] for k, v in to_receivers.items()})
               for i, h in enumerate(receivers)])
    sends = [h.send.remote(weights, version, fail_after) for h in senders]
    receives = [h.receive.remote(version if asked is None else asked) for h in receivers]
    try:
        return [_outcome(ref) for ref in sends], [_outcome(ref) for ref in receives]
    finally:
        ray.get([h.call.remote("finalize") for h in senders + receivers])


def test_every_receiver_gets_the_sent_tensors_in_order_with_their_dtypes(hosts):
    senders, receivers = hosts
    weights = _weights(0)
    sent, received = _sync(senders, receivers, weights, version=0)
    for tensors in received:
        assert [name for name, _ in tensors] == list(weights)
        for name, tensor in tensors:
            assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name])
    master, drained = sent
    assert master["weight_sync/tensors"] == len(weights) and master["weight_sync/buckets"] >= 3
    assert drained == {}  # the other actor rank takes part in the gathers but sends nothing


def test_a_second_version_replaces_the_first(hosts):
    senders, receivers = hosts
    _sync(senders, receivers, _weights(1), version=1)
    second = _weights(2)
    _, received = _sync(senders, receivers, second, version=2)
    for tensors in received:
        assert len(tensors) == len(second)
        assert all(torch.equal(tensor, second[name]) for name, tensor in tensors)


def test_a_receiver_refuses_buckets_of_another_version(hosts):
    senders, receivers = hosts
    _, received = _sync(senders, receivers, _weights(3), version=3, asked=4)
    for error in received:
        assert isinstance(error, WeightSyncError)
        assert "asked to load weight version 4, but bucket 0 is of version 3" in str(error)


def test_a_failed_sender_stops_the_receivers_with_its_error(hosts):
    senders, receivers = hosts
    sent, received = _sync(senders, receivers, _weights(5), version=5, fail_after=2)
    assert isinstance(sent[0], RuntimeError) and "gather failed" in str(sent[0])
    # The receivers were told, not left waiting for buckets that never come.
    for error in received:
        assert isinstance(error, WeightSyncError)
        assert "weight version 5 was not delivered: the sender (actor rank 0) failed after 2 tensors" in str(error)
    # The next sync starts from an empty mailbox.
    _, received = _sync(senders, receivers, _weights(6), version=6)
    assert all(len(tensors) == 4 for tensors in received)


def test_a_standalone_hf_server_loads_the_sent_weights_as_the_sent_version(hosts, tiny_model_dir):
    """Through the HF server adapter, as in a standalone replica: all-zero weights make every logit 0, so a greedy
    token's log-prob is exactly -log(vocabulary), and the server reports the version it loaded with each answer."""
    from transformers import AutoModelForCausalLM

    senders, receivers = hosts
    replica_rank = 1  # a standalone replica's rank follows the hybrid ones
    server = ray.remote(HFRolloutServer).options(name=SERVER_NAME.format(replica_rank=replica_rank), num_cpus=0).remote(
        model_path=str(tiny_model_dir), max_model_len=32, response_length=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    zeros = {name: torch.zeros_like(tensor) for name, tensor in model.state_dict().items()}
    metadata = ray.get([h.call.remote("prepare") for h in senders + receivers[:1]])
    to_senders, to_receivers = ObjectStoreCheckpointEngine.build_topology(len(senders), 1, metadata)
    ray.get([h.call.remote("init_process_group", mailbox=to_senders["mailbox"][i]) for i, h in enumerate(senders)]
            + [receivers[0].call.remote("init_process_group", mailbox=to_receivers["mailbox"][0])])
    try:
        ray.get([h.send.remote(zeros, 7) for h in senders] + [receivers[0].load_into_server.remote(7, replica_rank)])
    finally:
        ray.get([h.call.remote("finalize") for h in senders + receivers[:1]])
    out = ray.get(server.generate.remote([1, 2, 3], {"temperature": 0.0, "max_tokens": 1}, "request"))
    assert out.extra_fields["global_steps"] == 7
    assert out.log_probs[0] == pytest.approx(-math.log(model.config.vocab_size), abs=1e-6)
    ray.kill(server)


def test_a_receiver_refuses_tensors_that_are_not_the_senders(hosts):
    """The sender's fingerprint travels with the version's close; a bucket changed in the object store on the way (here
    replaced in the mailbox by one whose tensor differs in one element) is refused by every receiver, not loaded."""
    senders, receivers = hosts
    weights = _weights(8)
    metadata = ray.get([h.call.remote("prepare") for h in senders + receivers])
    name = next(entry["mailbox"] for entry in metadata if entry.get("mailbox"))
    mailbox = ray.get_actor(name)
    good = Fingerprint()
    for tensor in weights.values():
        good.add(tensor)
    changed = {key: tensor.clone() for key, tensor in weights.items()}
    changed["lm_head.bias"][0] += 1
    ray.get(mailbox.post.remote(9, [ray.put(changed)]))
    ray.get(mailbox.close.remote(summary={"fingerprint": good.total, "tensors": good.tensors, "node": "sender"}))
    for host in receivers:
        ray.get(host.call.remote("init_process_group", mailbox=name))
    try:
        for error in [_outcome(h.receive.remote(9)) for h in receivers]:
            assert isinstance(error, WeightSyncError), error
            assert "weight version 9: received 4 tensors with fingerprint" in str(error)
            assert "the weights changed on the way" in str(error)
    finally:
        ray.get([h.call.remote("finalize") for h in senders + receivers])
    # The same tensors as the sender fingerprinted them load.
    _, received = _sync(senders, receivers, weights, version=10)
    assert all(len(tensors) == 4 for tensors in received)


def test_build_topology_needs_exactly_one_sender():
    with pytest.raises(WeightSyncError, match="exactly one sender"):
        ObjectStoreCheckpointEngine.build_topology(2, 1, [{}, {}, {}])


def test_verl_finds_the_engine_by_the_names_the_launch_plan_writes():
    import_external_libs(CPU_CHECKPOINT_MODULE)  # what verl does with checkpoint_engine.custom_backend_module
    assert CPU_CHECKPOINT_ENGINE == BACKEND
    assert CheckpointEngineRegistry.get(CPU_CHECKPOINT_ENGINE) is ObjectStoreCheckpointEngine


def test_receive_before_init_process_group_says_what_is_missing():
    engine = ObjectStoreCheckpointEngine(bucket_size=1 << 20)

    async def first():
        return await anext(engine.receive_weights(global_steps=0))

    with pytest.raises(WeightSyncError, match="receive_weights before init_process_group"):
        asyncio.run(first())
