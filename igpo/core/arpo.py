"""ARPO: entropy-adaptive branching after tool calls, and its advantage attribution (docs/methods/arpo.md).

Symbols (one prompt; M = rollouts per prompt, N initial samples, Z branch factor, τ base rate, β entropy weight):

    token entropy   h_j = −Σ_{v∈V_j} q_{j,v} log q_{j,v} / log K,   q_{j,v} = exp(ℓ_{j,v}) / Σ_{u∈V_j} exp(ℓ_{j,u})
                    V_j: the K = top_k most likely entries the engine returned for position j (an extra entry the engine
                    adds for a sampled token outside its top-K is dropped, so every position has the same support);
                    q renormalises them to a distribution; dividing by log K puts h_j in [0, 1] for any vocabulary.
    step entropy    H_t = (1/k_t) Σ_{j<k_t} h_j,   k_t = min(k, n_t): the MEAN over the first k generated tokens after
                    tool result t (n_t tokens exist). H_init: the same over the first k tokens of the trajectory's
                    first turn (right after the prompt).
    change          ΔH_t = H_t − H_init, measured on the tokens after the CURRENT tool result (no one-round lag):
                    the turn after tool result t is generated, measured, and a branch then starts from tool result t
                    (it copies the prefix up to and including it and samples its own turn; the source keeps its own).
                    A branch inherits its source's H_init; a top-up is a fresh sample with its own.
    branching       P_t = clip(τ + β · ΔH_t, 0, 1). Each eligible trajectory makes Z − 1 attempts per round, attempt a
                    accepted iff u_a < P_t, u_a ~ U[0, 1) drawn from a generator keyed by (seed, step, rank, prompt,
                    round) and indexed by the trajectory's index in its prompt; accepted branches are granted in
                    index order while the prompt has fewer than M trajectories. One round per tool result: a branch's
                    first turn starts at its own branch point, which its source already branched from, so it is no
                    source there (``may_branch_at``); at most Z − 1 new paths per tool result.
    budget          when no trajectory of the prompt is running after a round and it has fewer than M, the missing
                    ones start as fresh top-ups, all in that round. Nothing is duplicated to reach M.
    sharing         D(i, j): how many response tokens trajectories i and j share by construction; the minimum of the
                    branch positions on the tree path between them (0 across different roots, D(i, i) = L).
                    S(i, p) = {j : D(i, j) > p}; positions p < D are token-identical (prefix identity).
    soft            Â_{i,p} = plain GRPO/IGPO over the M trajectories of the prompt (one group); a prefix shared by d
                    trajectories gets d copies of the gradient, i.e. d · mean advantage (implicit attribution).
    hard            Â^hard_{i,p} = (1/|S(i,p)|) · mean_{j∈S(i,p)} Â_{j,p} = Σ_{j∈S(i,p)} Â_{j,p} / |S(i,p)|²: every copy
                    carries the mean advantage of the trajectories that share the token, divided by |S| so that the
                    |S| copies together are ONE token with the mean advantage (Σ over the copies = mean_j Â_{j,p});
                    Â^hard = Â where |S| = 1 (so nothing branched ⇒ equal to soft).
    the loss        the copies of a shared token have one context, so one ratio ρ; verl's clipped PPO loss is linear in
                    the advantage for a given ρ and sign of A, so the copies' gradients add like their advantages.
                    With verl's loss_agg_mode, a shared token then weighs (soft: |S| tokens):
                    token-mean           1 token, over N = every trained token of the mini-batch, copies included (the
                                         relative weights are those of the de-duplicated batch, the scale N_distinct/N);
                    seq-mean-token-sum   1 token: exactly the de-duplicated batch's sum, over B sequences;
                    seq-mean-token-mean  1 token weighted mean_{j∈S}(1/n_j) (n_j: row j's trained tokens), i.e. the
                                         mean of its sharers' per-sequence weights.
                    Copies that verl's mini-batch split puts in different updates add up only to first order.

Scale of β (the one place it is stated; configs/igpo_base.yaml uses the same value): the reference sums 20 top-10
entropies and divides by log |V|, so its ΔH spans ≈ [−4, 4]; here ΔH is a mean of entropies normalised by log K and
lies in [−1, 1]. The reference's β = 0.2 on its scale corresponds here, with 20 measured tokens and Qwen2.5's
|V| ≈ 151,665, to β ≈ 0.2 · 20 · log 10 / log |V| ≈ 0.77: the default (``ARPOConfig.entropy_weight``).

Everything here is plain Python and tensors in, tensors out: the agent loop keeps one list of ``ARPOTrajectory``
records per prompt and step (created fresh every step, so no entropy leaks across steps or prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from igpo.core.advantage import group_ids

_MASK64 = (1 << 64) - 1
ATTRIBUTIONS = ("soft", "hard")


@dataclass(frozen=True)
class ARPOConfig:
    """``arpo``: every ARPO rollout knob. Defaults are the shipped 8B deep-search script (M 16, N 8, Z 2, τ 0.5, β 0.2
    on the reference's summed entropy, which is β 0.77 on this module's ΔH: module docstring).

    enabled: branch rollouts (False: plain sampling, the other knobs are still validated).
    rollouts_per_prompt: M, the number of trajectories each prompt ends with (the GRPO group size; reference
        ``rollout.n``).
    initial_rollouts: N ≤ M full samples started from the prompt; the other M − N slots go to branches and, when
        every trajectory of the prompt has finished first, to fresh top-ups.
    branch_factor: Z; an eligible trajectory tries Z − 1 branches per round (reference ``beam_size``). Z = 1 never
        branches: the M − N slots are then all top-ups, started once the N samples finished.
    branch_probability: τ, the branch probability at ΔH = 0 (the paper's base rate).
    entropy_weight: β in P = clip(τ + β·ΔH, 0, 1); ΔH here lies in [−1, 1]. 0.77 = the reference's 0.2 on its summed
        entropy (module docstring, "Scale of β"); 0 branches at the flat rate τ.
    entropy_tokens: k, how many generated tokens after a tool result (and at the start of the first turn) are
        measured (reference 20).
    top_k: K, how many log-probs per position the engine returns (reference 10); also the normaliser log K.
    seed: base seed of the branching draws; a step's draws are keyed by (seed, step, rank, prompt, round).
    attribution: ``soft`` (plain GRPO/IGPO over the branched group, the paper's default: a token shared by |S|
        trajectories is trained |S| times) or ``hard`` (every copy of a shared token gets the mean advantage of the
        trajectories sharing it divided by |S|, so the token is trained once: ``hard_attribution``).
    """

    enabled: bool = False
    rollouts_per_prompt: int = 16
    initial_rollouts: int = 8
    branch_factor: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.77
    entropy_tokens: int = 20
    top_k: int = 10
    seed: int = 0
    attribution: str = "soft"

    def __post_init__(self):
        if self.attribution not in ATTRIBUTIONS:
            raise ValueError(f"arpo.attribution={self.attribution!r} is unknown; use one of {ATTRIBUTIONS} (soft: "
                             "plain GRPO/IGPO over the branched group, the paper's default).")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"arpo.enabled={self.enabled!r} must be true or false.")
        for name, low in (("rollouts_per_prompt", 1), ("initial_rollouts", 1), ("branch_factor", 1),
                          ("entropy_tokens", 1), ("top_k", 2), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"arpo.{name}={value!r} must be an integer >= {low}.")
        if self.initial_rollouts > self.rollouts_per_prompt:
            raise ValueError(f"arpo.initial_rollouts={self.initial_rollouts} exceeds arpo.rollouts_per_prompt="
                             f"{self.rollouts_per_prompt}: N initial samples must fit in the M rollouts per prompt; "
                             "lower initial_rollouts (reference: M/2) or raise rollouts_per_prompt.")
        if not (isinstance(self.branch_probability, (int, float)) and not isinstance(self.branch_probability, bool)
                and 0.0 <= self.branch_probability <= 1.0):
            raise ValueError(f"arpo.branch_probability={self.branch_probability!r} must be a probability in [0, 1] "
                             "(reference 0.5).")
        if not (isinstance(self.entropy_weight, (int, float)) and not isinstance(self.entropy_weight, bool)
                and math.isfinite(self.entropy_weight) and self.entropy_weight >= 0):
            raise ValueError(f"arpo.entropy_weight={self.entropy_weight!r} must be a finite number >= 0 (default 0.77, "
                             "the paper's 0.2 on this ΔH scale; 0 branches at the flat rate branch_probability).")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "ARPOConfig":
        """From the ``arpo`` mapping; unknown keys raise with the known ones. ``initial_rollouts`` None means M // 2
        (at least 1), the shipped scripts' ratio."""
        unknown = sorted(set(section) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown key(s) arpo.{unknown}: check the spelling; known keys are "
                             f"{sorted(cls.__dataclass_fields__)}.")
        values = {k: v for k, v in dict(section).items() if v is not None or k == "initial_rollouts"}
        if values.get("initial_rollouts", 0) is None:
            m = values.get("rollouts_per_prompt", cls.rollouts_per_prompt)
            values["initial_rollouts"] = max(1, m // 2) if isinstance(m, int) else m
        for name in ("branch_probability", "entropy_weight"):
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        return cls(**values)


# ------------------------------------------------------------------------------------------------------ entropy


def token_entropy(top_logprobs: Tensor, top_k: int) -> Tensor:
    """h_j [...] from the engine's log-probs [..., E] of one position each (E ≥ top_k entries, −inf = no entry).

    Keeps the top_k largest entries (vLLM adds the sampled token when it is outside its top-K: dropped here),
    renormalises them (softmax) and returns their entropy divided by log top_k, in [0, 1].
    """
    if top_logprobs.dim() < 1 or not torch.is_floating_point(top_logprobs):
        raise ValueError(f"top_logprobs must be a float [..., E] tensor; got {top_logprobs.dtype} "
                         f"{tuple(top_logprobs.shape)}.")
    x = top_logprobs.double()
    if torch.isnan(x).any() or (x == math.inf).any():
        raise ValueError("top_logprobs contain NaN or +inf; pass the engine's log-probs, −inf for a missing entry.")
    if (x > 1e-6).any():
        raise ValueError(f"top_logprobs contain positive values (max {float(x.max()):.3g}); pass log-probabilities, "
                         "not logits or probabilities.")
    if x.shape[-1] > top_k:
        x = x.topk(top_k, dim=-1).values
    if (~torch.isfinite(x)).all(-1).any():
        raise ValueError("a position has no finite log-prob; every measured position needs at least one entry.")
    q = torch.softmax(x, dim=-1)
    plogp = torch.where(q > 0, q * torch.log(q), 0.0)
    return -plogp.sum(-1) / math.log(top_k)


def step_entropy(top_logprobs: Tensor, num_tokens: Tensor, cfg: ARPOConfig) -> Tensor:
    """H [B]: the mean of h_j over the first min(k, n_b) generated tokens of each row.

    top_logprobs [B, T, E]: per row, the log-probs of the tokens generated after a tool result (or after the prompt,
    for H_init), left-aligned; num_tokens [B]: n_b, how many of the T positions were generated. A row with n_b = 0 has
    no entropy: it raises (such a trajectory is not eligible to branch; do not pass it).
    """
    if top_logprobs.dim() != 3:
        raise ValueError(f"top_logprobs must be [B, T, E]; got {tuple(top_logprobs.shape)}.")
    B, T, _ = top_logprobs.shape
    if num_tokens.shape != (B,) or num_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_tokens must be an integer [B] = ({B},) tensor; got {num_tokens.dtype} "
                         f"{tuple(num_tokens.shape)}.")
    if bool((num_tokens > T).any()):
        raise ValueError(f"num_tokens {num_tokens.tolist()} exceed the T = {T} positions given.")
    empty = (num_tokens <= 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} generated no token to measure; only a trajectory that generated after the "
                         "tool result has an entropy (leave the others out of branching).")
    count = num_tokens.clamp(max=cfg.entropy_tokens)
    K = min(T, cfg.entropy_tokens)
    measured = torch.arange(K)[None, :] < count[:, None]
    x = torch.where(measured[..., None], top_logprobs[:, :K].double(), 0.0)  # unmeasured positions: any valid row
    h = torch.where(measured, token_entropy(x, cfg.top_k), 0.0)
    return h.sum(1) / count.double()


def branch_probability(delta_entropy: Tensor, cfg: ARPOConfig) -> Tensor:
    """P = clip(τ + β · ΔH, 0, 1), elementwise."""
    if not torch.isfinite(delta_entropy).all():
        raise ValueError("ΔH contains NaN or inf; an unmeasured trajectory must be left out of branching.")
    return (cfg.branch_probability + cfg.entropy_weight * delta_entropy.double()).clamp(0.0, 1.0)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int, rank: int, prompt: int, round_: int) -> int:
    """A 63-bit generator seed from (seed, step, rank, prompt, round); stable across processes and Python versions."""
    h = 0
    for part in (seed, step, rank, prompt, round_):
        if not isinstance(part, int) or part < 0:
            raise ValueError(f"branch draw key parts must be integers >= 0; got {part!r} in "
                             f"(seed, step, rank, prompt, round) = {(seed, step, rank, prompt, round_)}.")
        h = _splitmix64(h ^ part)
    return h >> 1


def branch_attempts(index: Sequence[int], delta_entropy: Tensor, cfg: ARPOConfig, *, step: int, rank: int,
                    prompt: int, round_: int) -> Tensor:
    """Accepted branch attempts [n, Z−1] (bool) of the eligible trajectories of ONE prompt in one round.

    index [n]: the trajectories' indices in their prompt (0..M−1); delta_entropy [n]: their ΔH. The uniforms come
    from a table [M, Z−1] drawn with ``draw_seed(cfg.seed, step, rank, prompt, round_)`` and are picked by index, so
    a trajectory's draw depends on neither the other trajectories' eligibility nor any entropy but its own.
    ``prompt`` is any integer stable for the prompt within the step (its index on this rank).
    """
    index = [int(i) for i in index]
    if delta_entropy.shape != (len(index),):
        raise ValueError(f"delta_entropy must be [n] = ({len(index)},), one per index; got "
                         f"{tuple(delta_entropy.shape)}.")
    if len(set(index)) != len(index) or any(not 0 <= i < cfg.rollouts_per_prompt for i in index):
        raise ValueError(f"index {index} must be distinct trajectory indices in [0, {cfg.rollouts_per_prompt}).")
    p = branch_probability(delta_entropy, cfg)
    generator = torch.Generator().manual_seed(draw_seed(cfg.seed, step, rank, prompt, round_))
    table = torch.rand(cfg.rollouts_per_prompt, cfg.branch_factor - 1, generator=generator, dtype=torch.float64)
    return table[torch.tensor(index, dtype=torch.long)] < p[:, None]


# ------------------------------------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class ARPOTrajectory:
    """One trajectory of a prompt in the current step.

    index: its position in the prompt's group, in creation order (initial 0..N−1, then branches and top-ups).
    parent: the index it was branched from, −1 for an initial sample or a top-up.
    branch_pos: response tokens [0, branch_pos) are the parent's, copied (the last tool result included); 0 for a root.
    is_topup: a fresh sample started because every trajectory of the prompt had finished with slots left.
    h_init: H_init, the entropy of its first turn's first k tokens (None until measured); a branch inherits it.
    """

    index: int
    parent: int = -1
    branch_pos: int = 0
    is_topup: bool = False
    h_init: float | None = None


@dataclass(frozen=True)
class RoundPlan:
    """What a prompt starts after one round: a branch from each entry of ``branch_sources`` (an index repeated for
    several branches of one source) and ``topups`` fresh samples from the prompt."""

    branch_sources: tuple[int, ...] = ()
    topups: int = 0


def may_branch_at(trajectory: ARPOTrajectory, point: int) -> bool:
    """Whether ``trajectory`` may become a branch source at the tool result ending at response token ``point``.

    A branch starts AT its ``branch_pos`` (the tool result it was copied through) and samples its own turn there: that
    tool result already had its round of branching (its source made up to Z − 1 new paths from it), so the branch's
    first turn is neither measured nor a branch point. Otherwise one tool result would get more than Z − 1 new paths
    (branches of branches at the same position, each round one more). Any later tool result of the branch may branch.
    """
    return not (trajectory.parent >= 0 and int(point) == trajectory.branch_pos)


def initial_trajectories(cfg: ARPOConfig) -> list[ARPOTrajectory]:
    """The N initial samples of one prompt at the start of a step (a fresh list every step: nothing carries over)."""
    return [ARPOTrajectory(index=i) for i in range(cfg.initial_rollouts)]


def with_initial_entropy(trajectory: ARPOTrajectory, h_init: float) -> ARPOTrajectory:
    """The record with H_init set from its first turn; a branch or a record already measured raises."""
    if trajectory.parent >= 0:
        raise ValueError(f"trajectory {trajectory.index} is a branch of {trajectory.parent}: it keeps its source's "
                         "H_init, measure only initial samples and top-ups.")
    if trajectory.h_init is not None:
        raise ValueError(f"trajectory {trajectory.index} already has H_init={trajectory.h_init}; it is measured once, "
                         "on its first turn.")
    if not math.isfinite(h_init):
        raise ValueError(f"H_init={h_init!r} of trajectory {trajectory.index} must be finite.")
    return replace(trajectory, h_init=float(h_init))


def plan_round(trajectories: Sequence[ARPOTrajectory], running: Sequence[bool], eligible: Sequence[bool],
               accepted: Tensor, cfg: ARPOConfig) -> RoundPlan:
    """Which trajectories of one prompt branch after this round, and how many top-ups start.

    running [m]: still generating after this round (finished ones: False); eligible [m]: generated this round right
    after a tool result and had the entropy of that turn measured; the branch point is that tool result, so a
    trajectory whose measured turn was its last (it answered) is eligible too. accepted [e, Z−1]: ``branch_attempts``
    of the eligible ones, in index order. Branches are granted in index order, at most Z − 1 per source, while the
    prompt has fewer than M trajectories. If then nothing runs and slots are left, all the missing trajectories start
    as top-ups now.
    """
    if not cfg.enabled:
        raise ValueError("arpo.enabled is false: there are no branching rounds to plan; start all "
                         "rollouts_per_prompt samples up front.")
    m = len(trajectories)
    if [t.index for t in trajectories] != list(range(m)):
        raise ValueError(f"trajectory indices {[t.index for t in trajectories]} must be 0..{m - 1} in order.")
    if len(running) != m or len(eligible) != m:
        raise ValueError(f"running ({len(running)}) and eligible ({len(eligible)}) need one entry per trajectory "
                         f"({m}).")
    if m > cfg.rollouts_per_prompt:
        raise ValueError(f"{m} trajectories exceed arpo.rollouts_per_prompt={cfg.rollouts_per_prompt}.")
    sources = [i for i in range(m) if eligible[i]]
    if accepted.shape != (len(sources), cfg.branch_factor - 1) or accepted.dtype != torch.bool:
        raise ValueError(f"accepted must be a bool [{len(sources)}, {cfg.branch_factor - 1}] tensor (eligible "
                         f"trajectories × Z−1 attempts); got {accepted.dtype} {tuple(accepted.shape)}.")
    left = cfg.rollouts_per_prompt - m
    branches: list[int] = []
    for source, row in zip(sources, accepted.sum(1).tolist()):
        grant = min(int(row), left - len(branches))
        branches.extend([source] * grant)
    left -= len(branches)
    topups = left if left > 0 and not branches and not any(running) else 0
    return RoundPlan(branch_sources=tuple(branches), topups=topups)


def apply_plan(trajectories: Sequence[ARPOTrajectory], plan: RoundPlan,
               response_lengths: Sequence[int]) -> list[ARPOTrajectory]:
    """The prompt's records with the plan's branches (then top-ups) appended, indices continuing.

    response_lengths [m]: where each trajectory's branch point lies, in response tokens (the end of the tool result
    after which its measured turn started); a branch copies that prefix (branch_pos) and its source's H_init.
    """
    if len(response_lengths) != len(trajectories):
        raise ValueError(f"response_lengths has {len(response_lengths)} entries for {len(trajectories)} trajectories.")
    out = list(trajectories)
    for source in plan.branch_sources:
        src = trajectories[source]
        if src.h_init is None:
            raise ValueError(f"source {source} has no H_init: measure a trajectory's first turn before it can branch.")
        if not may_branch_at(src, response_lengths[source]):
            raise ValueError(f"source {source} is a branch of {src.parent} starting at response token {src.branch_pos} "
                             f"and was asked to branch at that same tool result; a branch's first turn is not a branch "
                             "point (may_branch_at): leave it out of the round's eligible trajectories.")
        out.append(ARPOTrajectory(index=len(out), parent=source, branch_pos=int(response_lengths[source]),
                                  h_init=src.h_init))
    out += [ARPOTrajectory(index=len(out) + q, is_topup=True) for q in range(plan.topups)]
    return out


def branch_metadata(trajectories: Sequence[ARPOTrajectory], cfg: ARPOConfig) -> dict[str, np.ndarray]:
    """The prompt's tree as arrays, in index order: ``index``, ``parent``, ``branch_pos``, ``is_topup``.

    Raises unless exactly M trajectories exist (the group the advantage sees; never fill it by duplication).
    """
    if len(trajectories) != cfg.rollouts_per_prompt:
        raise ValueError(f"a prompt ended with {len(trajectories)} trajectories, not arpo.rollouts_per_prompt="
                         f"{cfg.rollouts_per_prompt}: the rollout must keep planning rounds until top-ups fill it.")
    return {
        "index": np.array([t.index for t in trajectories], dtype=np.int64),
        "parent": np.array([t.parent for t in trajectories], dtype=np.int64),
        "branch_pos": np.array([t.branch_pos for t in trajectories], dtype=np.int64),
        "is_topup": np.array([t.is_topup for t in trajectories], dtype=bool),
    }


# -------------------------------------------------------------------------------------------------- the tree


def soft_group_ids(uids: Sequence[Any]) -> Tensor:
    """Dense group ids [B] (first-appearance order) from the prompt uids: soft attribution is plain GRPO/IGPO with
    all M trajectories of a prompt, branches and top-ups included, in one group."""
    return group_ids(uids)


def _check_tree(group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor, L: int) -> None:
    B = group.shape[0]
    for name, t in (("group", group), ("index", index), ("parent", parent), ("branch_pos", branch_pos)):
        if t.shape != (B,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer [B] = ({B},) tensor; got {t.dtype} {tuple(t.shape)}.")
    roots = parent < 0
    if bool((roots & (branch_pos != 0)).any()) or bool((~roots & ((branch_pos < 0) | (branch_pos > L))).any()):
        raise ValueError(f"branch_pos {branch_pos.tolist()} must be 0 for roots (parent −1) and in [0, L={L}] for "
                         "branches.")
    if bool((~roots & (parent >= index)).any()):
        raise ValueError(f"parent {parent.tolist()} must be an earlier index of the same group than index "
                         f"{index.tolist()} (branches are created after their source).")


def _blocks(group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor,
            L: int) -> list[tuple[Tensor, Tensor]]:
    """Per prompt group that branched: (its rows [m], D among them [m, m]); groups without a branch share nothing
    and are left out. Work and memory are O(Σ m²), never O(B²)."""
    _check_tree(group, index, parent, branch_pos, L)
    rows_of: dict[int, list[int]] = {}
    for r, g in enumerate(group.tolist()):
        rows_of.setdefault(g, []).append(r)
    idx, par, pos = index.tolist(), parent.tolist(), branch_pos.tolist()
    out = []
    for g, rows in rows_of.items():
        local = {}
        for k, r in enumerate(rows):
            if idx[r] in local:
                raise ValueError(f"group {g} has index {idx[r]} twice (rows {rows[local[idx[r]]]} and {r}).")
            local[idx[r]] = k
        if all(par[r] < 0 for r in rows):
            continue
        # P[k, c]: min branch_pos on the path from k up to its ancestor c (L for c = k), −1 where c is no ancestor;
        # D[a, b] = max over common ancestors c of min(P[a, c], P[b, c]): the value at the lowest common ancestor.
        m = len(rows)
        P = torch.full((m, m), -1, dtype=torch.long)
        for k, r in enumerate(rows):
            P[k, k] = low = L
            while par[r] >= 0:
                if par[r] not in local:
                    raise ValueError(f"row {r}'s parent {par[r]} is not in group {g} of this batch.")
                low = min(low, pos[r])
                r = rows[local[par[r]]]
                P[k, local[idx[r]]] = low
        D = torch.minimum(P[:, None, :], P[None, :, :]).max(-1).values.clamp(min=0)
        out.append((torch.tensor(rows, dtype=torch.long), D))
    return out


def shared_lengths(group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor, L: int) -> Tensor:
    """D [B, B]: response tokens rows i and j share by construction (min branch position on their tree path; 0 across
    groups or roots; L on the diagonal). ``index``/``parent`` are within-group (a trajectory's number among its
    prompt's M and its parent's), so rows may come in any order (verl's balance_batch reorders them). Dense B × B:
    for checks and diagnostics."""
    B = group.shape[0]
    D = torch.eye(B, dtype=torch.long) * L
    for rows, d in _blocks(group, index, parent, branch_pos, L):
        D[rows[:, None], rows[None, :]] = d
    return D


def prefix_identical(responses: Tensor, group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor) -> Tensor:
    """[B] bool: each branch row equals its parent row on response positions [0, branch_pos); roots are True.
    Run it on response ids and on the response (loss) mask: both must hold for the metadata to be right."""
    B, L = responses.shape
    _check_tree(group, index, parent, branch_pos, L)
    row_of = {(g, i): r for r, (g, i) in enumerate(zip(group.tolist(), index.tolist()))}
    ok = torch.ones(B, dtype=torch.bool)
    for r in (parent >= 0).nonzero().flatten().tolist():
        key = (int(group[r]), int(parent[r]))
        if key not in row_of:
            raise ValueError(f"row {r}'s parent {key[1]} is not in group {key[0]} of this batch.")
        n = int(branch_pos[r])
        ok[r] = bool(torch.equal(responses[r, :n], responses[row_of[key], :n]))
    return ok


def _segments(D: Tensor) -> list[tuple[int, int, Tensor]]:
    """(a, b, E) per stretch [a, b) of response positions over which the sharing is fixed: E [m, m] = D ≥ b says which
    rows share positions a..b−1 (D takes only the group's branch positions, 0 and L, so between two consecutive
    values the relation D(i, j) > p cannot change). Stretches beyond the last shared position are left out."""
    ends = sorted(set(D.clone().fill_diagonal_(0).flatten().tolist()) - {0})
    return [(a, b, D >= b) for a, b in zip([0] + ends[:-1], ends)]


def share_counts(group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor, L: int) -> Tensor:
    """|S(i, p)| [B, L]: how many rows share response position p of row i (1 = only itself). 1/|S| is the loss
    weight that counts a shared token once under soft attribution's token-mean loss."""
    count = torch.ones(group.shape[0], L, dtype=torch.long)
    for rows, D in _blocks(group, index, parent, branch_pos, L):
        block = torch.ones(len(rows), L, dtype=torch.long)
        for a, b, E in _segments(D):
            block[:, a:b] = E.sum(1, keepdim=True)
        count.index_copy_(0, rows, block)
    return count


def hard_attribution(advantages: Tensor, response_mask: Tensor, group: Tensor, index: Tensor, parent: Tensor,
                     branch_pos: Tensor) -> Tensor:
    """``arpo_hard``: Â^hard_{i,p} = mean_{j∈S(i,p)} Â_{j,p} / |S(i,p)| from per-trajectory token advantages [B, L].

    The copies of a shared token sum to the sharers' mean advantage: the token is trained once (module docstring, "the
    loss", for what each of verl's loss_agg_modes makes of it); soft attribution trains it |S| times. Positions only
    row i owns keep Â_{i,p} exactly (so nothing branched ⇒ the input unchanged). The shared prefixes
    must carry the same response mask in every copy (else the metadata is wrong: raises). Cost: one [m, m] × [m, b−a]
    product per stretch of fixed sharing, per group that branched.
    """
    if advantages.dim() != 2 or not torch.is_floating_point(advantages):
        raise ValueError(f"advantages must be a float [B, L] tensor; got {advantages.dtype} {tuple(advantages.shape)}.")
    B, L = advantages.shape
    if response_mask.shape != (B, L):
        raise ValueError(f"response_mask {tuple(response_mask.shape)} must match advantages {(B, L)}.")
    blocks = _blocks(group, index, parent, branch_pos, L)
    out = advantages.clone()
    if not blocks:
        return out
    bad = (~prefix_identical(response_mask, group, index, parent, branch_pos)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rows {bad} differ from their parent's response mask before branch_pos; the branch metadata "
                         "does not describe these sequences.")
    for rows, D in blocks:
        block = advantages.index_select(0, rows)  # one gather per group: indexing [rows, a:b] is ~100× slower
        for a, b, E in _segments(D):
            count = E.sum(1, keepdim=True)
            own = block[:, a:b].double()
            block[:, a:b] = torch.where(count > 1, (E.double() / count ** 2) @ own, own).to(advantages.dtype)
        out.index_copy_(0, rows, block)
    return out


def shared_turn_weights(turn_end: Tensor, turn_valid: Tensor, group: Tensor, index: Tensor, parent: Tensor,
                        branch_pos: Tensor, L: int) -> tuple[Tensor, Tensor]:
    """How shared turns enter group statistics (e.g. the IG pool's μ/σ): (weight [B, T], first [B, T]).

    turn_end [B, T]: the exclusive end of the response tokens that determine turn t's value (IGPO's IG: through its
    tool result, i.e. its last generated token + 1, since branch points lie at tool-result ends; InfoPO's I_t: through
    the next action a_{t+1}); turn_valid [B, T]: the turns in the pool. A turn is shared by the rows j with
    D(i, j) ≥ turn_end whose copy (turn t of row j: a shared prefix has the same turns) is in the pool too;
    weight = 1/|shared| (the copies sum to one turn) and first = True on the copy of the lowest index only (a dedup
    mask: pool each turn once). Turns outside the pool get weight 0, first False.
    """
    B, T = turn_end.shape
    if turn_valid.shape != (B, T) or turn_valid.dtype != torch.bool:
        raise ValueError(f"turn_valid must be a bool [B, T] = {(B, T)} tensor; got {turn_valid.dtype} "
                         f"{tuple(turn_valid.shape)}.")
    if bool((turn_valid & ((turn_end < 1) | (turn_end > L))).any()):
        raise ValueError(f"valid turn ends must lie in [1, L={L}]; got {turn_end[turn_valid].tolist()}.")
    count = torch.ones(B, T, dtype=torch.long)
    first = torch.ones(B, T, dtype=torch.bool)
    for rows, D in _blocks(group, index, parent, branch_pos, L):
        shares = D[:, :, None] >= turn_end[rows][:, None, :]  # [m(i), m(j), T]: row j holds row i's turn t
        shares &= turn_valid[rows][None, :, :]  # ... and pools it
        count[rows] = shares.sum(1).clamp(min=1)
        idx = index[rows][None, :, None].expand_as(shares)
        lowest = torch.where(shares, idx, torch.iinfo(torch.long).max).min(1).values
        first[rows] = lowest == index[rows][:, None]
    return torch.where(turn_valid, 1.0 / count.double(), 0.0), turn_valid & first


# ------------------------------------------------------------------------------------------------------ metrics


def step_metrics(group: Tensor, index: Tensor, parent: Tensor, branch_pos: Tensor, is_topup: Tensor,
                 unmeasured: Tensor, delta_h: Sequence[float]) -> dict[str, float]:
    """``arpo/*`` metrics of one training step over the K trajectories that carry a tree (the arpo_agent loop's), in
    any order (verl's balance_batch reorders rows): ``group`` [K] (the prompt each belongs to), ``index``, ``parent``,
    ``branch_pos`` [K] (within the group, as in ``shared_lengths``), ``is_topup`` [K] bool, ``unmeasured`` [K] (turns
    whose ΔH could not be measured), ``delta_h`` (the ΔH of every measured turn, all trajectories together). Empty
    when K = 0 (ARPO off). Tool calls per trajectory are logged for every run, branched or not
    (``igpo/tool_calls_per_trajectory``).

    ``arpo/nested_branches``: branches whose parent is itself a branch; ``arpo/rebranch_same_point``: those of them
    with the parent's own branch_pos, i.e. a tool result that got a second round of branching through its own branch
    (``may_branch_at`` forbids it: must be 0)."""
    rows = int(group.shape[0])
    if not rows:
        return {}
    groups, idx, par, pos = group.tolist(), index.tolist(), parent.tolist(), branch_pos.tolist()
    prompts = len(set(groups))
    branches = sum(p >= 0 for p in par)
    row_of = {(g, i): r for r, (g, i) in enumerate(zip(groups, idx))}
    nested = rebranched = 0
    for r in range(rows):
        above = row_of.get((groups[r], par[r])) if par[r] >= 0 else None
        if above is not None and par[above] >= 0:
            nested += 1
            rebranched += pos[above] == pos[r]
    deltas = [float(d) for d in delta_h]
    return {
        "arpo/branches_per_prompt": branches / prompts,
        "arpo/branch_share": branches / rows,
        "arpo/nested_branches": float(nested),
        "arpo/rebranch_same_point": float(rebranched),
        "arpo/topups_per_prompt": int(is_topup.sum()) / prompts,
        "arpo/delta_h_mean": float(np.mean(deltas)) if deltas else 0.0,
        "arpo/measured_turns": float(len(deltas)),
        "arpo/unmeasured_turns": float(unmeasured.sum()),
    }
