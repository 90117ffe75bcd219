"""The generated world of the CPU demo: deterministic, answerable only by searching, split by person."""

import random
from pathlib import Path

import pyarrow.parquet as pq

from igpo.demo_world import WorldConfig, build_world, warm_start_plan, write_world

CORPUS = Path(__file__).resolve().parent.parent / "data" / "wiki_passages_1000.jsonl"


def test_world_is_deterministic_and_names_are_unique():
    a, b = build_world(WorldConfig(seed=3)), build_world(WorldConfig(seed=3))
    assert a == b
    names = [p.name for p in a.people] + list(a.companies) + list(a.cities)
    assert len(set(names)) == len(names)
    words = [w.lower() for name in names for w in name.split()]
    assert len(set(words)) == len(words) and min(map(len, words)) >= 4


def test_written_world_retrieves_every_entity_and_splits_people(tmp_path):
    paths = write_world(tmp_path, CORPUS)  # raises if a name does not retrieve its own passage first
    world = build_world()
    train = pq.read_table(paths["train"]).to_pylist()
    val = pq.read_table(paths["val"]).to_pylist()
    assert len(val) == 3 * len(world.split("val")) and len(train) == 3 * len(world.split("train"))
    val_people = {p.name for p in world.split("val")}
    assert all(any(name in row["prompt"][0]["content"] for name in val_people) for row in val)
    assert not any(any(name in row["prompt"][0]["content"] for name in val_people) for row in train)
    hq = next(q for q in world.questions("val") if q.kind == "hq")
    person = next(p for p in world.people if p.name == hq.person)
    assert hq.answer == world.companies[person.employer].hq


def test_warm_start_policy_is_imperfect_in_the_stated_ways():
    world = build_world()
    rng = random.Random(0)
    questions = world.questions("train")
    plans = [(q, warm_start_plan(world, q, rng)) for q in questions for _ in range(20)]
    searched = [(q, p) for q, p in plans if p.queries]
    right = sum(p.queries[0] == q.person for q, p in searched) / len(searched)
    assert 0.4 < right < 0.6
    hq = [(q, p) for q, p in searched if q.kind == "hq"]
    assert 0.15 < sum(len(p.queries) == 2 for _, p in hq) / len(hq) < 0.35
    assert 0.05 < 1 - len(searched) / len(plans) < 0.15
    # Every right two-hop plan that answers ends on the true answer.
    assert all(p.answer == q.answer for q, p in hq if len(p.queries) == 2 and p.queries[0] == q.person)
