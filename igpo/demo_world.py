"""A generated world for the CPU demo: fictional people, companies and cities, so no answer is in any model's weights.

Facts (seeded): every person was born in a city and works for a company; every company is headquartered in a city.
Each entity gets one corpus passage (Search-R1/FlashRAG JSONL, title = the entity's name):

    "Talven Moriske"    Talven Moriske was born in Ostrelle. Talven Moriske works for Quorvane.
    "Quorvane"          Quorvane is headquartered in Vesk. Quorvane builds lanterns.

The world's passages are added to the real Wikipedia sample (``data/wiki_passages_1000.jsonl``), which stays as
distractors. Questions, with the tool calls they need (searching the person's name ranks their passage first, and
the company's name ranks the company's passage first; both are checked when the data is written):

    one hop   Where was Talven Moriske born?                                     -> Ostrelle   (search the person)
    one hop   Which company does Talven Moriske work for?                        -> Quorvane   (search the person)
    two hops  In which city is the company Talven Moriske works for headquartered? -> Vesk     (then the company)

People are split into training and held-out validation people; companies and cities are shared (a validation
question names a person the warm-start never saw). ``warm_start_plan`` describes the imperfect policy the demo
model is warm-started into (igpo/warmstart.py): it searches the wrong person half of the time, rarely makes the
second hop, and sometimes answers without searching, so RL has something to learn and information gain has turns
that did and did not find the answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "demo_world"
ABILITY = "multi-hop search"
# The whole multi-turn response budget of the demo (rollout.response_length): two searches with their observations
# and the answer must fit without the loop forcing the answer early (the agent loop's budget rule).
RESPONSE_LENGTH = 768

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr", "st",
           "th", "sh", "qu", "vr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "sk", "nd", "rn", "x"]
_PRODUCTS = ["lanterns", "clocks", "ropes", "glass", "bicycles", "maps", "bells", "paper", "kettles", "looms",
             "boats", "tiles"]
# The name is quoted as the search call quotes its query ("query": ["<name>"]): after the opening quote, a small
# model can copy the name token by token from the question (an induction pattern) instead of recalling names.
QUESTIONS = {
    "born": 'Where was "{person}" born?',
    "employer": 'Which company does "{person}" work for?',
    "hq": 'In which city is the company "{person}" works for headquartered?',
}


@dataclass(frozen=True)
class WorldConfig:
    """Sizes of the world. seed: everything (names, facts, split, question order)."""

    people: int = 192
    val_people: int = 32
    companies: int = 24
    cities: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("people", "companies", "cities"):
            if getattr(self, name) < 2:
                raise ValueError(f"demo world: {name}={getattr(self, name)} must be >= 2")
        if not 1 <= self.val_people < self.people:
            raise ValueError(f"demo world: val_people={self.val_people} must be in [1, people={self.people})")


@dataclass(frozen=True)
class Person:
    name: str
    born: str
    employer: str


@dataclass(frozen=True)
class Company:
    name: str
    hq: str
    product: str


@dataclass(frozen=True)
class Question:
    kind: str          # born | employer | hq
    person: str
    question: str
    answer: str

    @property
    def hops(self) -> int:
        return 2 if self.kind == "hq" else 1


@dataclass(frozen=True)
class World:
    people: tuple[Person, ...]
    companies: dict[str, Company]
    cities: tuple[str, ...]
    val_names: frozenset[str]

    def split(self, name: str) -> list[Person]:
        """The training or the held-out validation people."""
        held_out = name == "val"
        return [p for p in self.people if (p.name in self.val_names) == held_out]

    def questions(self, split: str) -> list[Question]:
        out = []
        for person in self.split(split):
            answers = {"born": person.born, "employer": person.employer, "hq": self.companies[person.employer].hq}
            out += [Question(kind, person.name, QUESTIONS[kind].format(person=person.name), answers[kind])
                    for kind in QUESTIONS]
        return out

    def passages(self) -> list[dict]:
        """The world's corpus records, one per person and per company."""
        records = [{"id": f"world-p{i}", "contents": f'"{p.name}"\n{p.name} was born in {p.born}. '
                                                      f"{p.name} works for {p.employer}."}
                   for i, p in enumerate(self.people)]
        records += [{"id": f"world-c{i}", "contents": f'"{c.name}"\n{c.name} is headquartered in {c.hq}. '
                                                       f"{c.name} builds {c.product}."}
                    for i, c in enumerate(self.companies.values())]
        return records


def _word(rng: random.Random, syllables: int) -> str:
    """A pronounceable made-up word of at least 4 letters (shorter ones collide with English: "The", "Ban")."""
    while True:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if len(word) >= 4:
            return word.title()


def build_world(config: WorldConfig = WorldConfig()) -> World:
    """The seeded world: unique names across all entity kinds, facts drawn uniformly."""
    rng = random.Random(config.seed)
    used: set[str] = set()

    def fresh(make) -> str:
        while True:
            name = make()
            words = name.lower().split()
            if name not in used and not any(w in used for w in words):
                used.add(name)
                used.update(words)
                return name

    cities = tuple(fresh(lambda: _word(rng, 2)) for _ in range(config.cities))
    companies = {}
    for _ in range(config.companies):
        name = fresh(lambda: _word(rng, 2))
        companies[name] = Company(name, rng.choice(cities), rng.choice(_PRODUCTS))
    # Short person names (two one-syllable words): the policy copies them from the question into its query.
    people = tuple(Person(fresh(lambda: f"{_word(rng, 1)} {_word(rng, 1)}"), rng.choice(cities),
                          rng.choice(list(companies))) for _ in range(config.people))
    val = rng.sample([p.name for p in people], config.val_people)
    return World(people, companies, cities, frozenset(val))


@dataclass(frozen=True)
class PlannedTrajectory:
    """What the warm-start policy does for one question: the search queries in order, then the answer."""

    queries: tuple[str, ...]
    answer: str


def warm_start_plan(world: World, question: Question, rng: random.Random, *, p_right_person: float = 0.5,
                    p_second_hop: float = 0.25, p_no_search: float = 0.1) -> PlannedTrajectory:
    """One trajectory of the imperfect policy the demo model is warm-started into.

    It answers without searching with probability ``p_no_search`` (a random entity of the asked kind: the position
    after the prompt is also an answering position, so information gain is not just "answering after an
    observation"); otherwise it searches the asked person with probability ``p_right_person`` (else another training
    person) and answers with what that person's passage says. For a two-hop question it searches the company it read
    about with probability ``p_second_hop`` and answers that company's city; otherwise it answers the person's birth
    city, a plausible-looking shortcut that is usually wrong.
    """
    people = {p.name: p for p in world.people}
    if rng.random() < p_no_search:
        pool = list(world.companies) if question.kind == "employer" else list(world.cities)
        return PlannedTrajectory((), rng.choice(pool))
    if rng.random() < p_right_person:
        person = people[question.person]
    else:
        person = rng.choice([p for p in world.split("train") if p.name != question.person])
    if question.kind == "born":
        return PlannedTrajectory((person.name,), person.born)
    if question.kind == "employer":
        return PlannedTrajectory((person.name,), person.employer)
    if rng.random() < p_second_hop:
        return PlannedTrajectory((person.name, person.employer), world.companies[person.employer].hq)
    return PlannedTrajectory((person.name,), person.born)


def to_table(questions: list[Question], split: str):
    """verl RL rows (the schema of data/train_nq_256.parquet) as a pyarrow table."""
    import pyarrow as pa

    from igpo.demo_data import parquet_schema

    rows = [{
        "data_source": f"{DATA_SOURCE}_{q.kind}",
        "prompt": [{"content": q.question, "role": "user"}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": q.answer, "style": "rule"},
        "extra_info": {"index": f"{DATA_SOURCE}_{q.kind}_{q.person}", "split": split},
    } for q in questions]
    return pa.Table.from_pylist(rows, schema=parquet_schema())


def write_world(out_dir: str | Path, base_corpus: str | Path, config: WorldConfig = WorldConfig()) -> dict[str, Path]:
    """Write ``corpus.jsonl`` (base corpus + the world), ``train.parquet`` and ``val.parquet`` to ``out_dir``.

    Every question's searches are checked against the local BM25 backend over the written corpus: the person's
    name must retrieve the person's passage first, and the employer's name the company's passage first.
    """
    import asyncio

    import pyarrow.parquet as pq

    from tool_server.backends.local import LocalBackend

    world = build_world(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.jsonl"
    base = Path(base_corpus).read_text(encoding="utf-8").rstrip("\n")
    corpus.write_text(base + "\n" + "\n".join(json.dumps(r) for r in world.passages()) + "\n", encoding="utf-8")

    backend = LocalBackend(corpus)
    titles = {doc_id: json.loads(line)["contents"].split("\n")[0].strip('"')
              for line in corpus.read_text(encoding="utf-8").splitlines()
              for doc_id in [json.loads(line)["id"]]}

    async def first_title(query: str) -> str | None:
        hits = await backend.search_one(query, 1, deadline=float("inf"))
        return titles[hits[0].doc_id] if hits else None

    async def check() -> list[str]:
        names = [p.name for p in world.people] + list(world.companies)
        return [name for name in names if await first_title(name) != name]

    misses = asyncio.run(check())
    if misses:
        raise ValueError(f"demo world: searching {misses[:5]} does not rank their own passage first; change "
                         "WorldConfig.seed")
    paths = {"corpus": corpus}
    for split in ("train", "val"):
        questions = world.questions(split)
        random.Random(f"{config.seed}:{split}").shuffle(questions)
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(to_table(questions, split), paths[split])
    return paths


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="directory for corpus.jsonl, train.parquet, val.parquet")
    parser.add_argument("--base-corpus", required=True, help="real passages kept as distractors, e.g. "
                                                             "data/wiki_passages_1000.jsonl")
    parser.add_argument("--seed", type=int, default=WorldConfig.seed)
    args = parser.parse_args()
    for path in write_world(args.out_dir, args.base_corpus, WorldConfig(seed=args.seed)).values():
        print(path)


if __name__ == "__main__":
    main()
