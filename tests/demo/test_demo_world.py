"""The generated world of the CPU demo: deterministic, answerable only by searching, split by person, and the demo's
configuration agrees with the settings the demo model is warm-started with."""

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from igpo.demo import world as demo_world
from igpo.demo.world import WorldConfig, build_world, practice_world, warm_start_plan, write_world

REPO = Path(__file__).resolve().parents[2]
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
    # every row names the entities its correct searches name, in order (the loop's hop_right is read against them)
    targets = {row["extra_info"]["index"]: row["extra_info"]["hop_targets"] for row in train + val}
    assert targets[f"demo_world_hq_{hq.person}"] == [hq.person, world.employer[hq.person]]
    assert targets[f"demo_world_employer_{hq.person}"] == [hq.person]
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


# ---- the long-horizon task (demo.task=chain) ------------------------------------------------------------------------


def test_chain_world_keeps_the_names_and_facts_and_adds_two_relations():
    hops, chain = build_world(), build_world(WorldConfig(task="chain"))
    assert chain == build_world(WorldConfig(task="chain")) and chain.task == "chain" and hops.task == "hops"
    assert (chain.employer, chain.hq, chain.val_names) == (hops.employer, hops.hq, hops.val_names)
    assert chain.vocabulary() == hops.vocabulary()  # the same tokenizer
    assert all(chain.mentor[p] != p and chain.mentor[p] in chain.employer for p in chain.employer)
    assert set(chain.founder) == set(chain.hq) and set(chain.founder.values()) <= set(chain.employer)
    questions = chain.questions("val") + chain.questions("train")
    assert {q.kind for q in questions} == {"mentor2", "mentor3"} and {q.hops for q in questions} == {2, 3}
    assert len(chain.questions("val")) == 2 * len(chain.split("val"))
    # A three-search chain back to the asked person would repeat its first search: such questions are left out.
    loops = [p for p in chain.split("train") if chain.mentor[chain.mentor[p]] == p]
    assert loops and len(chain.questions("train")) == 2 * len(chain.split("train")) - len(loops)
    for q in questions:
        path = chain.chain(q)
        assert len(path) == q.hops and path[0] == q.person and len(set(path)) == len(path)
        assert path == chain.hop_targets(q)
        # each searched person's passage names the next one, their mentor (and the last one's names the answer)
        assert path[1:] + [q.answer] == [chain.mentor[p] for p in path]
    passage = next(r["contents"] for r in chain.passages() if r["contents"].startswith(f'"{questions[0].person}"'))
    import re

    assert len(set(re.findall(r"@\w+", passage))) == 2  # the person and a second handle (its mentor): a distractor


def test_chain_world_is_written_and_every_entity_retrieves_its_own_passage(tmp_path):
    paths = write_world(tmp_path, CORPUS, WorldConfig(task="chain"))  # raises otherwise
    val = pq.read_table(paths["val"]).to_pylist()
    assert {row["data_source"] for row in val} == {"demo_world_mentor2", "demo_world_mentor3"}
    assert all(row["extra_info"]["hop_targets"][0] == row["prompt"][0]["content"].split()[-1] for row in val)
    practice = practice_world(build_world(WorldConfig(task="chain")), 0)
    person = practice.split("train")[0]
    assert f"{person} is mentored by {practice.mentor[person]}." in paths["practice_corpus"].read_text()


def test_chain_warm_start_policy_knows_the_protocol_but_often_stops_before_the_end():
    world = practice_world(build_world(WorldConfig(task="chain")), 0)
    rng = random.Random(0)
    plans = [(q, warm_start_plan(world, q, rng)) for q in world.questions("train") for _ in range(20)]
    correct = sum(p.answer == q.answer for q, p in plans) / len(plans)
    p_search, p_next = 1 - demo_world.CHAIN_P_NO_SEARCH, demo_world.CHAIN_P_NEXT_HOP
    complete = sum(p_search * p_next ** (q.hops - 1) for q, _ in plans) / len(plans)
    assert abs(correct - (complete + (1 - complete) / len(world.employer))) < 0.02, (correct, complete)
    searched = [(q, p) for q, p in plans if p.queries]
    assert abs(len(searched) / len(plans) - p_search) < 0.02
    for q, p in searched:  # every search names the chain's next entity, read from the previous passage
        assert list(p.queries) == world.chain(q)[:len(p.queries)]
    assert all(p.answer == q.answer for q, p in searched if len(p.queries) == q.hops)



def test_the_chain_plan_probabilities_can_be_given_and_default_to_the_calibrated_ones():
    """warmstart --chain-plan (a model calibrated on another CPU type) reaches chain_plan; without it the plans are
    the calibrated defaults' draw for draw."""
    world = practice_world(build_world(WorldConfig(task="chain")), 0)
    questions = world.questions("train")
    default = [warm_start_plan(world, q, random.Random(1)) for q in questions]
    same = [warm_start_plan(world, q, random.Random(1), chain=(demo_world.CHAIN_P_NO_SEARCH,
                                                              demo_world.CHAIN_P_NEXT_HOP)) for q in questions]
    assert default == same
    rng = random.Random(0)
    plans = [(q, warm_start_plan(world, q, rng, chain=(0.0, 1.0))) for q in questions]
    assert all(list(p.queries) == world.chain(q) and p.answer == q.answer for q, p in plans)
    rng = random.Random(0)
    assert all(not p.queries for p in (warm_start_plan(world, q, rng, chain=(1.0, 0.5)) for q in questions))


@pytest.mark.parametrize("argv, fragment", [
    (["--chain-plan", "0.35"], "give two probabilities"),
    (["--chain-plan", "0.35,1.5"], "give two probabilities"),
    (["--chain-plan", "a,b"], "give two probabilities"),
])
def test_warmstart_chain_plan_errors_name_the_value(argv, fragment, tmp_path, monkeypatch, capsys):
    from igpo.demo import warmstart

    monkeypatch.setattr("sys.argv", ["warmstart", "--base", str(tmp_path), "--corpus", str(tmp_path / "c.jsonl"),
                                     "--out", str(tmp_path / "out"), "--task", "chain", "--world-seed", "0", *argv])
    with pytest.raises(SystemExit):
        warmstart.main()
    err = capsys.readouterr().err
    assert fragment in err and argv[1] in err, err
    monkeypatch.setattr("sys.argv", ["warmstart", "--base", str(tmp_path), "--corpus", str(tmp_path / "c.jsonl"),
                                     "--out", str(tmp_path / "out"), "--chain-plan", "0.3,0.5"])
    with pytest.raises(SystemExit):
        warmstart.main()
    assert "add --task chain --world-seed N" in capsys.readouterr().err

def test_cpu_demo_chain_config_matches_the_chain_settings():
    text = (REPO / "configs" / "demo" / "chain.yaml").read_text()
    assert text.startswith("# @package _global_")
    config = yaml.safe_load(text)
    assert config["algorithm"]["igpo"]["agent"]["max_turns"] == demo_world.CHAIN_MAX_TURNS
    assert config["data"]["max_response_length"] == demo_world.CHAIN_RESPONSE_LENGTH
    rollout = config["actor_rollout_ref"]["rollout"]
    assert rollout["response_length"] == demo_world.CHAIN_RESPONSE_LENGTH
    assert rollout["max_model_len"] >= demo_world.PROMPT_LENGTH + demo_world.CHAIN_RESPONSE_LENGTH
    assert config["data"]["val_batch_size"] == len(build_world(WorldConfig(task="chain")).questions("val"))
    settings = demo_world.warm_start_config(task="chain")
    assert (settings.max_turns, settings.response_length) == (demo_world.CHAIN_MAX_TURNS,
                                                              demo_world.CHAIN_RESPONSE_LENGTH)


def test_an_unknown_demo_task_is_refused_by_the_launcher():
    import subprocess

    out = subprocess.run(["bash", "train_igpo.sh", "--dry-run", "demo.task=chains"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "demo.task=chains is unknown" in out.stderr
