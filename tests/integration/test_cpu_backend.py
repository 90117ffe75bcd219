"""The CPU backend without Ray: the HF rollout server's sampling log-probs and vLLM-style prompt_logprobs match a
plain forward of the same model; the plugin registers everything in a fresh process.

The fresh processes are children forked from one Python that has imported torch, transformers, ray and the other
third-party libraries but nothing of igpo, verl or tool_server (fresh_imports.py): what the tests check happens in the
child as in ``python -c``, for one interpreter start instead of one per process (~6 CPU-seconds each here)."""

import asyncio

import pytest
import torch

from fresh_imports import run_fresh


def test_hf_server_logprobs_match_a_plain_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from igpo.cpu.hf_rollout import HFRolloutServer

    server = HFRolloutServer(str(tiny_model_dir), max_model_len=256, response_length=16)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    async def run():
        prompts = [[5, 17, 300, 42], [9, 8, 7, 6, 5, 4, 3]]  # different lengths: exercises left padding
        params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "prompt_logprobs": 0}
        return prompts, await asyncio.gather(*[server.generate(p, params, request_id=str(i))
                                               for i, p in enumerate(prompts)])

    prompts, outputs = asyncio.run(run())
    for prompt, out in zip(prompts, outputs):
        assert 1 <= len(out.token_ids) <= 6 and len(out.log_probs) == len(out.token_ids)
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logp = model(full).logits.float().log_softmax(-1)[0]
        expected = logp[torch.arange(len(prompt) - 1, full.shape[1] - 1), full[0, len(prompt):]]
        assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)
        prompt_lp = out.extra_fields["prompt_logprobs"]
        assert len(prompt_lp) == len(prompt) and prompt_lp[-1] == [0.0]
        expected_prompt = logp[torch.arange(len(prompt) - 1), full[0, 1:len(prompt)]]
        assert torch.allclose(torch.tensor([v[0] for v in prompt_lp[:-1]]), expected_prompt, atol=1e-4)


def test_a_request_seed_fixes_its_tokens_whatever_shares_its_batch(tiny_model_dir):
    """vLLM's per-request ``seed``: the same prompt and seed give the same tokens alone or batched with other
    requests; another seed gives other tokens; unseeded requests still sample."""
    from igpo.cpu.hf_rollout import HFRolloutServer

    server = HFRolloutServer(str(tiny_model_dir), max_model_len=256, response_length=24, seed=0)
    prompt = [5, 17, 300, 42]
    params = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 24}

    async def generate(requests):
        return await asyncio.gather(*[server.generate(p, dict(params, **extra), request_id=str(i))
                                      for i, (p, extra) in enumerate(requests)])

    async def run():  # one event loop: the server's request queue lives on it
        alone = (await generate([(prompt, {"seed": 11})]))[0].token_ids
        crowd = await generate([([9, 8, 7, 6, 5, 4, 3, 2], {"seed": 1}), (prompt, {"seed": 11}), ([3, 4], {})])
        others = await generate([(prompt, {"seed": s}) for s in range(6)])
        return alone, crowd, others

    alone, crowd, others = asyncio.run(run())
    assert crowd[1].token_ids == alone
    assert len({tuple(out.token_ids) for out in others}) > 1


def test_the_server_pauses_for_a_weight_update_as_verls_async_modes_need(tiny_model_dir):
    """abort_all_requests stops the batch being decoded and answers it with the tokens it has (stop_reason aborted,
    one log-prob per token), returns only once no forward pass runs; a request behind the closed gate waits and is
    served on the weights loaded meanwhile after resume_generation; with reject_request it is answered at once."""
    from igpo.cpu.hf_rollout import HFRolloutServer

    server = HFRolloutServer(str(tiny_model_dir), max_model_len=512, response_length=400, seed=0)
    server.eos_ids = set()  # never stop early: only the abort or max_tokens ends a generation
    prompt = [5, 17, 300, 42]

    async def run():
        long = asyncio.create_task(server.generate(prompt, {"max_tokens": 400, "seed": 3}, request_id="long"))
        while server._idle.is_set():  # until its batch is decoding
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        report = await server.abort_all_requests()
        assert server._idle.is_set(), "abort returned while a forward pass was running"
        cut = await long
        late = asyncio.create_task(server.generate(prompt, {"max_tokens": 3, "seed": 4}, request_id="late"))
        await asyncio.sleep(0.2)
        waiting = not late.done()
        server.set_global_steps(7)  # as a weight update would
        await server.resume_generation()
        served = await late
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(prompt, {"max_tokens": 3}, request_id="rejected")
        await server.resume_generation()
        after = await server.generate(prompt, {"max_tokens": 3}, request_id="after")
        return report, cut, waiting, served, rejected, after

    report, cut, waiting, served, rejected, after = asyncio.run(run())
    assert cut.stop_reason == "aborted" and 0 < len(cut.token_ids) < 400, (cut.stop_reason, len(cut.token_ids))
    assert len(cut.log_probs) == len(cut.token_ids) and report["aborted_count"] == 1
    assert waiting and served.stop_reason == "length" and len(served.token_ids) == 3
    assert served.extra_fields["global_steps"] == 7
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert after.stop_reason == "length" and len(after.token_ids) == 3


def test_inverse_cdf_sampling_follows_the_filtered_distribution():
    """_sample draws token k with its top-k/top-p-filtered probability (checked against the exact probabilities on
    20,000 uniform draws); temperature 0 is greedy."""
    from igpo.cpu.hf_rollout import _sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 20000
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(0))

    def frequencies(top_p, top_k, temperature=1.0):
        rows = logits.expand(n, -1)
        chosen = _sample(rows, torch.full((n,), temperature), torch.full((n,), top_p),
                         torch.full((n,), top_k, dtype=torch.long), uniform)
        return torch.bincount(chosen, minlength=4).float() / n

    assert torch.allclose(frequencies(1.0, -1), torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)
    assert torch.allclose(frequencies(1.0, 2), torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015)
    assert torch.allclose(frequencies(0.7, -1), torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015)
    assert frequencies(1.0, -1, temperature=0.0).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_hf_server_rejects_a_prompt_that_fills_the_context(tiny_model_dir):
    import pytest

    from igpo.cpu.hf_rollout import HFRolloutServer

    server = HFRolloutServer(str(tiny_model_dir), max_model_len=4, response_length=4)
    with pytest.raises(ValueError, match="max_model_len=4"):
        asyncio.run(server.generate([1, 2, 3, 4], {}, request_id="x"))


PLUGIN_CODE = (
    "import verl, igpo.plugin as p\n"
    "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as A\n"
    "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as L\n"
    "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY as T\n"
    "from verl.workers.rollout.replica import RolloutReplicaRegistry as R\n"
    "from verl.plugin.platform.platform_manager import PlatformRegistry as P\n"
    "assert not p.FAILED, p.FAILED\n"
    "assert 'igpo' in A and 'grpo_info_gain' in A and 'igpo_agent' in L and 'igpo_sync' in T\n"
    "assert 'hf' in R._registry and P.get('cpu') is not None\n"
    "print('ok')\n"
)

FIRST_IMPORTS = ["igpo.integration.actor_worker", "igpo.agent.agent_loop", "igpo.agent.arpo_loop",
                 "igpo.integration.estimator", "igpo.integration.trainer", "igpo.integration.actor_scoring",
                 "igpo.cpu.hf_rollout", "igpo.config"]
FIRST_IMPORT_CODE = (
    "import importlib, sys\n"
    "importlib.import_module(sys.argv[1])\n"
    "import igpo.plugin as p\n"
    "from hydra.utils import get_class\n"
    "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as A\n"
    "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as L\n"
    "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY as T\n"
    "assert not p.FAILED, p.FAILED\n"
    "assert 'igpo' in A and 'grpo_info_gain' in A and 'igpo_sync' in T, (sorted(A), sorted(T))\n"
    "assert get_class(L['igpo_agent']['_target_']).__name__ == 'IGPOAgentLoop'\n"
    "assert get_class(L['arpo_agent']['_target_']).__name__ == 'ARPOAgentLoop'\n"
    "print('ok')\n"
)

# IGPO_LAZY_REGISTRATION=1 (the processes of a run igpo.main starts): `import verl` leaves the estimator, the trainer
# mode and the modules the CPU patches change unimported; each registration and patch lands when its verl module is
# imported; the TaskRunner registers the estimator and trainer mode before verl's run (stubbed here).
LAZY_CODE = (
    "import sys, verl, igpo.plugin as p\n"
    "untouched = ['igpo.integration.estimator', 'igpo.integration.trainer', 'verl.workers.engine',\n"
    "             'verl.workers.engine_workers', 'verl.experimental.agent_loop.agent_loop', 'verl.workers.rollout.base']\n"
    "assert not [m for m in untouched if m in sys.modules], [m for m in untouched if m in sys.modules]\n"
    "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as L\n"
    "from verl.workers.rollout import base\n"
    "from verl.workers.rollout.replica import RolloutReplicaRegistry as R\n"
    "import verl.workers.engine_workers as workers, verl.utils.distributed as distributed\n"
    "from verl.workers.engine.base import EngineRegistry as E\n"
    "assert 'igpo_agent' in L and 'arpo_agent' in L and 'hf' in R._registry\n"
    "assert base._ROLLOUT_REGISTRY[('vllm', 'async')] == p.VLLM_ADAPTER\n"
    "assert base._ROLLOUT_REGISTRY[('hf', 'async')] == 'igpo.cpu.hf_rollout.HFServerAdapter'\n"
    "assert workers.initialize_global_process_group_ray is distributed.initialize_global_process_group_ray\n"
    "assert distributed.initialize_global_process_group_ray._igpo_cpu\n"
    "assert all('cpu' in by_device for engines in E._engines.values() for name, by_device in engines.items()\n"
    "           if name.startswith('fsdp') and 'cuda' in by_device)\n"
    "assert not p.FAILED and p._HOOKS not in sys.meta_path, (p.FAILED, p._HOOKS.waiting)\n"
    "from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as A\n"
    "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY as T\n"
    "assert 'igpo' not in A and 'igpo_sync' not in T\n"
    "from verl.trainer.main_ppo import TaskRunnerV1\n"
    "TaskRunnerV1.__ray_actor_class__.run = lambda self, config: 'verl ran'\n"
    "from igpo.integration.task_runner import _TaskRunner\n"
    "assert _TaskRunner().run(None) == 'verl ran'\n"
    "assert 'igpo' in A and 'grpo_info_gain' in A and 'infopo' in A and 'igpo_sync' in T, (sorted(A), sorted(T))\n"
    "print('ok')\n"
)

REACH_PROBE_CODE = "import sys, igpo.integration.node_reach\nassert 'verl' not in sys.modules\nprint('ok')\n"


@pytest.fixture(scope="module")
def fresh():
    """{name: {"returncode", "stdout", "stderr"}} of each snippet of this file, each run in a fresh process."""
    jobs = {"plugin": {"code": PLUGIN_CODE, "env": {"VERL_PLATFORM": "cpu"}},
            "lazy": {"code": LAZY_CODE, "env": {"VERL_PLATFORM": "cpu", "IGPO_LAZY_REGISTRATION": "1"}},
            "reach_probe": {"code": REACH_PROBE_CODE},
            **{first: {"code": FIRST_IMPORT_CODE, "argv": [first]} for first in FIRST_IMPORTS}}
    return dict(zip(jobs, run_fresh(list(jobs.values()))))


def test_plugin_registers_everything_in_a_fresh_process(fresh):
    result = fresh["plugin"]
    assert result["returncode"] == 0 and "ok" in result["stdout"], result["stderr"][-3000:]


def test_lazy_registration_lands_where_each_verl_module_is_imported(fresh):
    result = fresh["lazy"]
    assert result["returncode"] == 0 and "ok" in result["stdout"], result["stderr"][-3000:]
    assert "engine is not available" not in result["stderr"], result["stderr"][-3000:]


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_importing_any_of_our_modules_first_loads_every_registration(fresh, first):
    """A Ray worker that unpickles a class of ours imports its module before anything else (the actor worker; the
    agent loop; a probe task): that import reaches verl, whose plugin hook then imports the registering modules while
    the first one is half imported. Every registration must still load, with no warning, and the agent loops must be
    the classes their paths name. One process per first import."""
    result = fresh[first]
    assert result["returncode"] == 0 and "ok" in result["stdout"], (first, result["stderr"][-3000:])
    assert "failed to import" not in result["stderr"], (first, result["stderr"][-3000:])


def test_the_tool_server_reach_probe_does_not_import_verl(fresh):
    """The probe's Ray task unpickles igpo.integration.node_reach alone; importing verl there started a plugin import cycle."""
    result = fresh["reach_probe"]
    assert result["returncode"] == 0 and "ok" in result["stdout"], result["stderr"][-3000:]
