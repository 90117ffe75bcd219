"""The generated world of the CPU demo: deterministic, answerable only by searching, split by person, and the demo's
configuration agrees with the settings the demo model is warm-started with."""

import random
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from igpo.demo import world as demo_world
from igpo.demo.world import WorldConfig, build_world, practice_world, warm_start_plan, write_world

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "wiki_passages_1000.jsonl"


def test_world_is_deterministic_and_names_are_unique_single_words():
    a, b = build_world(WorldConfig(seed=3)), build_world(WorldConfig(seed=3))
    assert a == b
    names = a.vocabulary()
    assert len(set(n.lower() for n in names)) == len(names) == 128 + 16 + 12
    assert all(" " not in n and len(n.lstrip("@#")) >= 4 for n in names)
    assert all(p.startswith("@") for p in a.employer) and all(c.startswith("#") for c in a.hq)


def test_practice_world_keeps_the_names_and_redraws_the_facts():
    world = build_world()
    practice = practice_world(world, 0)
    assert practice.vocabulary() == world.vocabulary() and not practice.val_names
    assert len(practice.questions("train")) == 2 * len(world.employer)
    same = sum(practice.employer[p] == c for p, c in world.employer.items()) / len(world.employer)
    assert same < 0.2  # 1/16 by chance


def test_written_world_retrieves_every_entity_and_splits_people(tmp_path):
    paths = write_world(tmp_path, CORPUS)  # raises if a name does not retrieve its own passage first
    world = build_world()
    train = pq.read_table(paths["train"]).to_pylist()
    val = pq.read_table(paths["val"]).to_pylist()
    assert len(val) == 2 * len(world.split("val")) and len(train) == 2 * len(world.split("train"))
    val_people = set(world.split("val"))
    assert all(row["prompt"][0]["content"].split()[-1] in val_people for row in val)
    assert not any(row["prompt"][0]["content"].split()[-1] in val_people for row in train)
    hq = next(q for q in world.questions("val") if q.kind == "hq")
    assert hq.answer == world.hq[world.employer[hq.person]]
    assert paths["vocabulary"].read_text().split() == world.vocabulary()
    practice_text = paths["practice_corpus"].read_text()
    person = world.split("val")[0]
    assert f"{person} works for {practice_world(world, 0).employer[person]}." in practice_text
    # Writing it again leaves every file as it is (a concurrent launch's tool server may hold the corpus open).
    times = {key: path.stat().st_mtime_ns for key, path in paths.items()}
    assert {key: path.stat().st_mtime_ns for key, path in write_world(tmp_path, CORPUS).items()} == times


def test_warm_start_policy_is_imperfect_in_the_stated_ways():
    world = practice_world(build_world(), 0)
    rng = random.Random(0)
    plans = [(q, warm_start_plan(world, q, rng)) for q in world.questions("train") for _ in range(10)]
    searched = [(q, p) for q, p in plans if p.queries]
    assert 0.3 < len(searched) / len(plans) < 0.5
    assert all(p.queries[0] == q.person for q, p in searched)
    hq = [(q, p) for q, p in searched if q.kind == "hq"]
    assert 0.2 < sum(len(p.queries) == 2 for _, p in hq) / len(hq) < 0.4
    # Every plan that reads what it needs answers right.
    assert all(p.answer == q.answer for q, p in searched if len(p.queries) == q.hops)


def test_cpu_demo_config_matches_the_warm_start_settings():
    config = yaml.safe_load((REPO / "configs" / "cpu_demo.yaml").read_text())
    agent = config["algorithm"]["igpo"]["agent"]
    assert agent["system_prompt"] == demo_world.SYSTEM_PROMPT
    assert agent["tool_names"] == ["search"]
    assert (agent["max_turns"], agent["max_tokens_per_turn"], agent["max_observation_tokens"]) == (
        demo_world.MAX_TURNS, demo_world.MAX_TOKENS_PER_TURN, demo_world.MAX_OBSERVATION_TOKENS)
    rollout = config["actor_rollout_ref"]["rollout"]
    assert (rollout["prompt_length"], rollout["response_length"]) == (demo_world.PROMPT_LENGTH,
                                                                      demo_world.RESPONSE_LENGTH)
    assert (config["data"]["max_prompt_length"], config["data"]["max_response_length"]) == (
        demo_world.PROMPT_LENGTH, demo_world.RESPONSE_LENGTH)
    script = (REPO / "train_igpo.sh").read_text()
    assert f'TOOL_TOPK="${{TOOL_TOPK:-{demo_world.TOPK}}}"' in script
