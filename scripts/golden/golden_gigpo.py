"""Golden data for GiGPO from verl-agent's OWN functions (issue 46): run ``gigpo/core_gigpo.py`` of a verl-agent
snapshot, loaded at run time, on seeded random batches of turns, and write the inputs with the outputs to
tests/golden/gigpo_reference.json. tests/core/test_gigpo.py compares ``igpo.core.gigpo`` with the file.

    python scripts/golden/golden_gigpo.py --verl-agent /path/to/verl-agent[.git] \
        [--out tests/golden/gigpo_reference.json]
    python scripts/golden/golden_gigpo.py --verl-agent /path/to/verl-agent[.git] --similarity \
        [--out tests/golden/gigpo_similarity_reference.json]

``--verl-agent`` is a checkout, a git directory (a bare one is fine: the file is read with ``git show HEAD:<path>``)
or the file itself. Nothing of verl-agent is copied into this repository: the file is written to a temporary
directory, imported there with a stand-in for its one unavailable import (``from verl import DataProto``, a type it
only names) and deleted; only inputs and outputs are kept.

Functions used: ``compute_step_discounted_returns`` (step returns per trajectory), ``episode_norm_reward`` (both
values of ``compute_mean_std_cross_all_data``), ``build_step_group``, ``step_norm_reward`` and, for the default
episode pool, ``compute_gigpo_outcome_advantage`` (the estimator verl-agent's trainer calls).

How our batch becomes theirs (one row per environment step there, one sequence per trajectory here):
  - each kept turn t of trajectory i is one step row, rows ordered trajectory by trajectory and turn by turn (the
    order in which verl-agent's rollout gathers them); ``index`` = the prompt group, ``traj_index`` = the trajectory;
  - the step reward of a row is the outcome R_i on the trajectory's last turn and 0 before it (verl-agent's search
    environment rewards the answer step); ``token_level_rewards`` of a row sums to R_i (its episode reward manager
    puts the episode reward on every step row's last token), in a one-token response with mask 1;
  - the invalid-action penalty c is subtracted from a malformed row's token reward and from its step return after
    discounting, as verl-agent's trainer (``apply_invalid_action_penalty``) does; written here, not run from it;
  - returns are discounted over all turns of a trajectory; turns and trajectories that our infrastructure-failure
    policy masks are then left out of the rows passed to the normalisation functions (verl-agent has no masking);
  - anchors are strings: "q" for the question, labels of observations drawn from a small pool (repeated states)
    or unique ones, and for the history variant the "|"-joined labels so far.

``--similarity`` writes the second file, tests/golden/gigpo_similarity_reference.json, for similarity step groups
(``enable_similarity=True``, which verl-agent's search recipe turns on; tests/core/test_gigpo_similarity.py reads it).
Its core_gigpo.py must have the similarity arguments (github.com/my1ab/verl-agent-remote-backup has them; the snapshot
of the first file predates them). The batches are built as above, with real-looking anchor texts instead of labels:
the group's question on turn 0, then search results cut from data/wiki_passages_1000.jsonl, exact repeats of
earlier texts, variants a few characters away (most join at 0.9) or many characters away (they should not),
results that share one passage of two or three, and empty observations. Recorded: ``build_step_group(...,
enable_similarity=True, similarity_thresh=τ)`` (as dense ids by first appearance), the step returns, and
``episode_norm_reward``, ``step_norm_reward`` and ``compute_gigpo_outcome_advantage(..., enable_similarity=True,
similarity_thresh=τ)`` (the default episode pool: the estimator has no switch for the other) for τ ∈ {0.5, 0.9, 0.95}.
The texts are stored once per case and the anchors as indices into them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import random
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
MODES = ("mean_norm", "mean_std_norm")
POOLS = ("step_rows", "trajectories")
DEFAULT_OUT = REPO / "tests" / "golden" / "gigpo_reference.json"
SIMILARITY_OUT = REPO / "tests" / "golden" / "gigpo_similarity_reference.json"
PASSAGES = REPO / "data" / "wiki_passages_1000.jsonl"
CORE_PATH = "gigpo/core_gigpo.py"
SOURCES = {False: "github.com/langfengQ/verl-agent (as carried by the fork github.com/zhangyun04/verl-agent)",
           True: "github.com/my1ab/verl-agent-remote-backup"}


def read_core(source: Path) -> tuple[str, str | None]:
    """(text of core_gigpo.py, commit or None) from a file, a checkout or a (bare) git directory."""
    if source.is_file():
        return source.read_text(), None
    if (source / CORE_PATH).is_file():
        return (source / CORE_PATH).read_text(), _commit(source)
    return _git(source, "show", f"HEAD:{CORE_PATH}"), _commit(source)


def _git(source: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={source}", *args], check=True, capture_output=True, text=True).stdout


def _commit(source: Path) -> str | None:
    for git_dir in (source, source / ".git"):
        try:
            return _git(git_dir, "rev-parse", "HEAD").strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            continue
    return None


def load_core(text: str) -> types.ModuleType:
    """Import the file from a temporary directory, with a stand-in for ``verl.DataProto`` (a type hint there)."""
    stand_in = types.ModuleType("verl")
    stand_in.DataProto = object
    sys.modules.setdefault("verl", stand_in)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "core_gigpo.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location("verl_agent_core_gigpo", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


# ---- random batches --------------------------------------------------------------------------------------------


def random_case(rng: random.Random, *, groups: int, per_group: int, max_turns: int, outcome: str, repeat: float,
                invalid_rate: float, masks: bool, history: bool) -> list[dict]:
    """Trajectories as our side sees them: group, outcome, num_turns, rows (kept step rows), invalid, anchors."""
    trajectories = []
    pool = [f"o{k}" for k in range(3)]
    for g in range(groups):
        equal = rng.choice([0.0, 1.0, 0.375])
        for _ in range(per_group):
            n = rng.randint(1, max_turns)
            if outcome == "binary":
                r = float(rng.random() < 0.5)
            elif outcome == "equal":
                r = equal
            else:  # an F1-like score, on a 1/16 grid (exact in float32: see cases())
                r = rng.randint(0, 16) / 16
            labels = ["q"]
            for t in range(1, n):
                labels.append(rng.choice(pool) if rng.random() < repeat else f"u{len(trajectories)}_{t}")
            anchors = ["|".join(labels[:t + 1]) for t in range(n)] if history else labels
            rows = [True] * n
            if masks and rng.random() < 0.15:
                rows = [False] * n  # the whole trajectory masked (mask_trajectory)
            elif masks and n >= 3 and rng.random() < 0.3:
                rows[rng.randint(0, n - 2)] = False  # one turn masked (mask_turn never masks the last turn)
            trajectories.append({"group": g, "outcome": r, "num_turns": n, "rows": rows,
                                 "invalid": [rng.random() < invalid_rate for _ in range(n)], "anchors": anchors})
    return trajectories


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Their group statistics are tensors built from Python lists (``torch.tensor(...)``), whose dtype is torch's
    default: run them in float64 so the comparison measures the formulas, not float32 rounding."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _step_rows(core: types.ModuleType, trajectories: list[dict], config: dict) -> dict:
    """Our kept turns as verl-agent's step rows (module docstring): their [trajectory, turn], episode scores, step
    returns (penalty after discounting), anchors, ``index`` and ``traj_index``."""
    penalty, gamma = config["invalid_action_penalty"], config["gamma"]
    # Step returns over every turn of every trajectory (masking comes after, as ours).
    rewards, traj_uid = [], []
    for i, traj in enumerate(trajectories):
        n = traj["num_turns"]
        rewards += [traj["outcome"] if t == n - 1 else 0.0 for t in range(n)]
        traj_uid += [f"traj{i}"] * n
    batch = SimpleNamespace(
        non_tensor_batch={"rewards": np.array(rewards, dtype=object), "traj_uid": np.array(traj_uid, dtype=object),
                          "active_masks": np.ones(len(rewards), dtype=object)},
        batch={"input_ids": torch.zeros(1, dtype=torch.long)})
    all_returns = core.compute_step_discounted_returns(batch, gamma).double()

    rows, scores, returns, anchors, index, traj_index = [], [], [], [], [], []
    position = 0
    for i, traj in enumerate(trajectories):
        for t in range(traj["num_turns"]):
            if traj["rows"][t]:
                cost = penalty * float(traj["invalid"][t])
                rows.append([i, t])
                scores.append(traj["outcome"] - cost)
                returns.append(float(all_returns[position + t]) - cost)
                anchors.append(traj["anchors"][t])
                index.append(f"group{traj['group']}")
                traj_index.append(f"traj{i}")
        position += traj["num_turns"]
    anchor_obs = np.empty(len(anchors), dtype=object)
    anchor_obs[:] = anchors
    return {"rows": rows, "scores": scores, "returns": returns, "anchor_obs": anchor_obs,
            "index": np.array(index, dtype=object), "traj_index": np.array(traj_index, dtype=object)}


def run_reference(core: types.ModuleType, trajectories: list[dict], config: dict) -> dict:
    """verl-agent's outputs, one entry per kept step row (``rows``: their [trajectory, turn])."""
    step_rows = _step_rows(core, trajectories, config)
    rows, returns = step_rows["rows"], step_rows["returns"]
    if not rows:
        return {"rows": [], "returns": [], "episode": [], "step": [], "advantage": [], "step_group": []}
    token_rewards = torch.tensor(step_rows["scores"], dtype=torch.float64)[:, None]
    mask = torch.ones_like(token_rewards)
    step_rewards = torch.tensor(returns, dtype=torch.float64)
    anchor_obs, index, traj_index = step_rows["anchor_obs"], step_rows["index"], step_rows["traj_index"]
    remove_std = config["mode"] == "mean_norm"
    eps = config["epsilon"]
    with contextlib.redirect_stdout(io.StringIO()), default_dtype(torch.float64):
        episode = core.episode_norm_reward(token_rewards.clone(), mask, index, traj_index, eps, remove_std,
                                           compute_mean_std_cross_all_data=config["episode_pool"] == "step_rows")
        uids = core.build_step_group(anchor_obs, index)
        step = core.step_norm_reward(step_rewards, mask, uids, eps, remove_std)
        if config["episode_pool"] == "step_rows":  # the estimator verl-agent's trainer calls
            advantage, _ = core.compute_gigpo_outcome_advantage(
                token_rewards.clone(), step_rewards, mask, anchor_obs, index, traj_index, eps,
                config["step_advantage_weight"], config["mode"])
        else:  # the estimator has no switch for the other pool: combine its parts as it does
            advantage = episode + config["step_advantage_weight"] * step
    return {"rows": rows, "returns": returns, "episode": episode[:, 0].tolist(), "step": step[:, 0].tolist(),
            "advantage": advantage[:, 0].tolist(), "step_group": _dense(uids)}


def _dense(uids) -> list[int]:
    """verl-agent's step-group uuids as dense ids by first appearance (a partition compared as such)."""
    dense: dict[str, int] = {}
    return [dense.setdefault(u, len(dense)) for u in uids]


def cases(seed: int) -> list[dict]:
    """Both modes x both episode pools over batches with repeated and unique states, equal outcomes in a group,
    omega != 1, gamma < 1, the invalid-action penalty, masked turns and trajectories, groups of one."""
    rng = random.Random(seed)
    out = []
    shapes = [
        dict(name="repeated_states", groups=3, per_group=4, max_turns=4, outcome="binary", repeat=0.8,
             invalid_rate=0.0, masks=False, history=False),
        dict(name="unique_states", groups=2, per_group=4, max_turns=4, outcome="f1", repeat=0.0, invalid_rate=0.0,
             masks=False, history=False),
        dict(name="equal_outcomes", groups=3, per_group=3, max_turns=3, outcome="equal", repeat=0.6,
             invalid_rate=0.0, masks=False, history=False),
        dict(name="f1_penalty_masks", groups=4, per_group=4, max_turns=5, outcome="f1", repeat=0.7,
             invalid_rate=0.25, masks=True, history=False),
        dict(name="history_anchors", groups=3, per_group=5, max_turns=4, outcome="binary", repeat=0.9,
             invalid_rate=0.1, masks=False, history=True),
        dict(name="groups_of_one", groups=4, per_group=1, max_turns=3, outcome="f1", repeat=0.5, invalid_rate=0.2,
             masks=False, history=False),
    ]
    # (gamma, omega, penalty). verl-agent's step returns are float32 (its function casts them): with these gammas and
    # outcomes on a 1/16 grid they are exact, so dividing by a small step-group sigma cannot magnify their rounding.
    # verl-agent's own gamma, 0.95, runs in the last two cases with mean_norm, where nothing divides.
    settings = [(1.0, 1.0, 0.0), (0.875, 1.0, 0.1), (0.75, 0.5, 0.1), (0.5, 2.0, 0.0)]
    combos = [(shape, mode, pool) for shape in shapes for mode in MODES for pool in POOLS]
    # Rotated by one per shape, so every mode and pool meets every setting.
    combos = [(shape, mode, pool, settings[(k + k // 4) % 4]) for k, (shape, mode, pool) in enumerate(combos)]
    gamma_095 = dict(name="verl_agent_gamma", groups=3, per_group=4, max_turns=5, outcome="binary", repeat=0.7,
                     invalid_rate=0.2, masks=True, history=False)
    combos += [(gamma_095, "mean_norm", pool, (0.95, 1.0, 0.1)) for pool in POOLS]
    for shape, mode, pool, (gamma, omega, penalty) in combos:
        case_seed = rng.randrange(2 ** 31)
        params = {k: v for k, v in shape.items() if k != "name"}
        trajectories = random_case(random.Random(case_seed), **params)
        config = {"mode": mode, "episode_pool": pool, "gamma": gamma, "step_advantage_weight": omega,
                  "invalid_action_penalty": penalty, "epsilon": 1e-6}
        out.append({"name": f"{shape['name']}/{mode}/{pool}/gamma{gamma}/omega{omega}/c{penalty}",
                    "seed": case_seed, "config": config, "trajectories": trajectories})
    return out


# ---- similarity step groups ----------------------------------------------------------------------------------


def run_similarity_reference(core: types.ModuleType, trajectories: list[dict], config: dict, texts: list[str],
                             threshold: float) -> dict:
    """verl-agent's outputs with similarity step groups at ``threshold``, one entry per kept step row (anchors are
    indices into ``texts``)."""
    named = [dict(traj, anchors=[texts[k] for k in traj["anchors"]]) for traj in trajectories]
    step_rows = _step_rows(core, named, config)
    token_rewards = torch.tensor(step_rows["scores"], dtype=torch.float64)[:, None]
    mask = torch.ones_like(token_rewards)
    step_rewards = torch.tensor(step_rows["returns"], dtype=torch.float64)
    anchor_obs, index, traj_index = step_rows["anchor_obs"], step_rows["index"], step_rows["traj_index"]
    remove_std = config["mode"] == "mean_norm"
    eps = config["epsilon"]
    with contextlib.redirect_stdout(io.StringIO()), default_dtype(torch.float64):
        episode = core.episode_norm_reward(token_rewards.clone(), mask, index, traj_index, eps, remove_std)
        uids = core.build_step_group(anchor_obs, index, enable_similarity=True, similarity_thresh=threshold)
        step = core.step_norm_reward(step_rewards, mask, uids, eps, remove_std)
        advantage, _ = core.compute_gigpo_outcome_advantage(
            token_rewards.clone(), step_rewards, mask, anchor_obs, index, traj_index, eps,
            config["step_advantage_weight"], config["mode"], enable_similarity=True, similarity_thresh=threshold)
    return {"rows": step_rows["rows"], "returns": step_rows["returns"], "episode": episode[:, 0].tolist(),
            "step": step[:, 0].tolist(), "advantage": advantage[:, 0].tolist(), "step_group": _dense(uids)}


def read_passages(path: Path = PASSAGES) -> list[tuple[str, str]]:
    """(title, body) of each passage of the local corpus (``"Title"\\nbody`` in its ``contents``)."""
    passages = []
    for line in path.read_text().splitlines():
        title, _, body = json.loads(line)["contents"].partition("\n")
        passages.append((title.strip('"'), body))
    return passages


class _Texts:
    """One case's anchor texts, stored once each; ``add`` returns a text's index."""

    def __init__(self, rng: random.Random, passages: list[tuple[str, str]], long: bool):
        self.rng, self.passages, self.long = rng, passages, long
        self.texts: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if text not in self.index:
            self.index[text] = len(self.texts)
            self.texts.append(text)
        return self.index[text]

    def question(self) -> str:
        title, body = self.rng.choice(self.passages)
        return f"Answer the question, searching as needed: {body[:self.rng.randint(40, 120)]} ... what is {title}?"

    def result(self, shared: str | None = None) -> str:
        """A search result of the local tool's form: one cut passage, or (long cases) two or three whole ones, one
        of them ``shared`` with an earlier result when given."""
        rng = self.rng
        k = rng.randint(2, 3) if self.long else 1
        docs = [rng.randrange(len(self.passages)) for _ in range(k)]
        parts = []
        for n, d in enumerate(docs):
            title, body = self.passages[d]
            if not self.long:
                start = rng.randrange(max(1, len(body) - 150))
                body = body[start:start + rng.randint(120, 450)]
            parts.append(f"{n + 1}. [{title}](corpus://{d})\n{body}")
        if shared is not None:
            parts[rng.randrange(k)] = shared
        query = " ".join(rng.choice(self.passages[rng.randrange(len(self.passages))][1].split()) for _ in range(3))
        return f"A search for '{query}' found {k} results:\n\n" + "\n\n".join(parts)

    def edited(self, text: str, edits: int) -> str:
        """``text`` with ``edits`` random one-character substitutions, insertions or deletions."""
        rng, chars = self.rng, list(text)
        for _ in range(edits):
            k, op = rng.randrange(len(chars) + 1), rng.random()
            if op < 0.5 and k < len(chars):
                chars[k] = rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 .,")
            elif op < 0.75:
                chars.insert(k, rng.choice("abcdefghijklmnopqrstuvwxyz "))
            elif k < len(chars):
                del chars[k]
        return "".join(chars)


def similarity_trajectories(rng: random.Random, passages: list[tuple[str, str]], *, groups: int, per_group: int,
                            max_turns: int, long: bool, invalid_rate: float,
                            masks: bool) -> tuple[list[dict], list[str]]:
    """Trajectories as ``random_case`` builds them, with text anchors (indices into the returned texts)."""
    texts = _Texts(rng, passages, long)
    trajectories = []
    for g in range(groups):
        question = texts.add(texts.question())
        seen: list[str] = []
        for _ in range(per_group):
            n = rng.randint(1, max_turns)
            anchors = [question]
            for _ in range(1, n):
                u = rng.random()
                if u < 0.05:
                    text = ""  # an empty observation
                elif seen and u < 0.25:
                    text = rng.choice(seen)  # the same observation again
                elif seen and u < 0.55:
                    text = texts.edited(rng.choice(seen), rng.randint(1, 3))  # a few characters away
                elif seen and u < 0.65:
                    base = rng.choice(seen)
                    text = texts.edited(base, max(1, len(base) // 4))  # many characters away
                elif seen and u < 0.75 and long:
                    text = texts.result(shared=rng.choice(seen).split("\n\n")[-1])  # one passage in common
                else:
                    text = texts.result()
                if text:
                    seen.append(text)
                anchors.append(texts.add(text))
            r = rng.randint(0, 16) / 16  # an F1-like score on a 1/16 grid (exact in float32: see cases())
            rows = [True] * n
            if masks and rng.random() < 0.15:
                rows = [False] * n
            elif masks and n >= 3 and rng.random() < 0.3:
                rows[rng.randint(0, n - 2)] = False
            trajectories.append({"group": g, "outcome": r, "num_turns": n, "rows": rows,
                                 "invalid": [rng.random() < invalid_rate for _ in range(n)], "anchors": anchors})
    return trajectories, texts.texts


def similarity_cases(seed: int, passages: list[tuple[str, str]]) -> list[dict]:
    """Both modes at τ ∈ {0.9 (verl-agent's search recipe), 0.95 (its config default), 0.5}, over cut passages and
    long multi-passage results, with γ < 1, ω ≠ 1, the invalid-action penalty and masked turns; as in ``cases()``,
    verl-agent's own γ = 0.95 runs with mean_norm only."""
    rng = random.Random(seed)
    shapes = [dict(name="cut_passages", groups=3, per_group=4, max_turns=6, long=False, invalid_rate=0.2,
                   masks=True),
              dict(name="long_results", groups=2, per_group=4, max_turns=6, long=True, invalid_rate=0.1,
                   masks=False)]
    settings = {"mean_norm": [(0.95, 1.0, 0.1), (0.875, 2.0, 0.1)],
                "mean_std_norm": [(0.875, 1.0, 0.1), (0.75, 0.5, 0.1)]}
    out = []
    for shape in shapes:
        for threshold in (0.9, 0.95, 0.5):
            for mode in MODES:
                gamma, omega, penalty = settings[mode][(len(out) // 2) % 2]
                case_seed = rng.randrange(2 ** 31)
                params = {k: v for k, v in shape.items() if k != "name"}
                trajectories, texts = similarity_trajectories(random.Random(case_seed), passages, **params)
                config = {"mode": mode, "episode_pool": "step_rows", "gamma": gamma, "step_advantage_weight": omega,
                          "invalid_action_penalty": penalty, "epsilon": 1e-6}
                out.append({"name": f"{shape['name']}/tau{threshold}/{mode}/gamma{gamma}/omega{omega}/c{penalty}",
                            "seed": case_seed, "threshold": threshold, "config": config, "texts": texts,
                            "trajectories": trajectories})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl-agent", type=Path, required=True,
                        help="verl-agent checkout, git directory or gigpo/core_gigpo.py itself")
    parser.add_argument("--similarity", action="store_true",
                        help="write the similarity-step-group cases (default --out "
                             f"{SIMILARITY_OUT.relative_to(REPO)})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--source", default=None, help="where the snapshot comes from, as recorded in the file")
    parser.add_argument("--seed", type=int, default=46)
    args = parser.parse_args()
    out = args.out or (SIMILARITY_OUT if args.similarity else DEFAULT_OUT)
    text, commit = read_core(args.verl_agent)
    core = load_core(text)
    recorded = []
    if args.similarity:
        for case in similarity_cases(args.seed, read_passages()):
            case["expected"] = run_similarity_reference(core, case["trajectories"], case["config"], case["texts"],
                                                        case["threshold"])
            recorded.append(case)
    else:
        for case in cases(args.seed):
            case["expected"] = run_reference(core, case["trajectories"], case["config"])
            recorded.append(case)
    golden = {"source": args.source or SOURCES[args.similarity], "commit": commit, "file": CORE_PATH,
              "generated_by": "scripts/golden/golden_gigpo.py" + (" --similarity" if args.similarity else ""),
              "seed": args.seed, "cases": recorded}
    # One case per line: the file stays reviewable in a diff without a line per number.
    head = json.dumps({k: v for k, v in golden.items() if k != "cases"}, indent=1)[:-2]
    body = ",\n".join(json.dumps(case) for case in recorded)
    out.write_text(f'{head},\n "cases": [\n{body}\n ]\n}}\n')
    rows = sum(len(c["expected"]["rows"]) for c in recorded)
    print(f"golden_gigpo: {len(recorded)} cases, {rows} step rows -> {out}")


if __name__ == "__main__":
    main()
