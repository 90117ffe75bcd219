"""A generated world for the CPU demo: fictional people, companies and cities, so no answer is in any model's weights.

Facts (seeded): every person works for a company; every company is headquartered in a city. People go by handles
("@Talven"), companies by tags ("#Quorvane"), as on a social site; every handle, tag and city is one token of the
demo tokenizer (``World.vocabulary``). Each entity gets one corpus passage (Search-R1/FlashRAG JSONL, title = the
handle), whose last word is its one fact:

    "@Talven"     @Talven works for #Quorvane.
    "#Quorvane"   #Quorvane is headquartered in Vesk.

The world's passages are added to the real Wikipedia sample (``data/wiki_passages_1000.jsonl``), which stays as
distractors; the demo's tool server returns the top hit (``TOPK``). Questions, with the tool calls they need
(searching a handle or a tag ranks its own passage first; checked when the data is written):

    one hop   Employer of @Talven                           -> #Quorvane  (search @Talven)
    two hops  Headquarters city of the employer of @Talven  -> Vesk       (search @Talven, then #Quorvane)

People are split into training and held-out validation people (validation asks about people RL never trained on).
The demo model never sees this world's facts before RL: it is warm-started (igpo/demo/warmstart.py) on a practice world
(``practice_world``: the same names, facts drawn anew) into the imperfect policy of ``warm_start_plan``: it often
answers at once with a guess and rarely makes the second hop, so RL has something to learn, and information gain
has turns that did and did not find the answer. What it can do from the start is copy a name it has just read into
a query or an answer (``igpo.demo.tiny_model.pretrain_copy``), the one skill of a pretrained LM the demo relies on.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from igpo.agent import HOP_TARGETS_KEY
from igpo.demo.warmstart_config import WarmStartConfig

DATA_SOURCE = "demo_world"
ABILITY = "multi-hop search"
QUESTIONS = {
    "employer": "Employer of {person}",
    "hq": "Headquarters city of the employer of {person}",
}
# The long-horizon task (demo.task=chain): every answer is a person, found only at the end of a chain of two or three
# dependent searches (mentor after mentor: the answers spread over most of the 128 people, where a chain through the
# 16 companies' founders would let a policy guess among 16).
CHAIN_QUESTIONS = {
    "mentor2": "Mentor of the mentor of {person}",
    "mentor3": "Mentor of the mentor of the mentor of {person}",
}
TASKS = ("hops", "chain")
PERSON_MARK, COMPANY_MARK = "@", "#"
# The facts of the practice world the demo model is warm-started on: another draw over the same names.
PRACTICE_SEED_OFFSET = 1_000_003

# The demo's agent settings; configs/cpu_demo.yaml repeats them (algorithm.igpo.agent, rollout lengths) and
# tests/demo/test_demo_world.py checks that both agree. Two searches with their observations and the answer fit the
# response budget without the loop forcing the answer early (the agent loop's budget rule).
SYSTEM_PROMPT = ('Answer the question. To search, write <tool_call>{"name": "search", "arguments": {"query": '
                 '["..."]}}</tool_call>. To answer, write <answer>...</answer>.')
PROMPT_LENGTH = 128
RESPONSE_LENGTH = 384
MAX_TURNS = 4
MAX_TOKENS_PER_TURN = 32          # a search call is ~20 tokens of the demo tokenizer
MAX_OBSERVATION_TOKENS = 96
TOPK = 1                          # passages per search (the tool server's --default-topk in the demo)
WARM_START_STEPS = 600
WARM_START_LR = 3e-3
WARM_START_PLANS = 2              # trajectories of the warm-start policy per practice question
# The chain task (demo.task=chain; configs/demo/chain.yaml repeats these, a test checks they agree): three searches
# and the answer, plus three spare turns for mistakes, fit the response budget.
CHAIN_MAX_TURNS = 7
CHAIN_RESPONSE_LENGTH = 640
# Its warm-start policy (chain_plan), calibrated on the sampled step-1 success of the model it trains
# (scripts/experiments/calibrate_chain.py; results/chain_compare_v2/plan.md): 5-15% of trajectories correct, >= 4x a
# guess.
CHAIN_P_NO_SEARCH = 0.35
CHAIN_P_NEXT_HOP = 0.35
# The real model (demo.model=smollm2, igpo/demo/real_model.py; configs/demo_model/smollm2.yaml repeats these, a test
# checks they agree). Its tokenizer splits every name into several tokens: a search call is ~31 tokens, a search result
# 40-51, its frame up to 52 (the answer-now instruction included), a prompt ~72. Two searches and the answer fit
# without the loop forcing the answer (every warm-start plan plays to its end; at 400 / 44 five of 512 did not).
MODELS = ("tiny", "smollm2")
SMOLLM2_MAX_TOKENS_PER_TURN = 48
SMOLLM2_MAX_OBSERVATION_TOKENS = 56
SMOLLM2_RESPONSE_LENGTH = 416
# Its warm-start (the raw model writes no tool call: all its turns are prose). A full fine-tune of an instruct model
# learns the fixed call format in a few dozen small steps, at a much lower lr than the tiny model's from-scratch 3e-3
# (measured: loss 2.0 -> ~0.3 by step 20, and 0.95 of sampled turns well-formed after 28 steps). Bound by steps, not
# by time (so the model is the same on any machine): ~33 s a step on two busy cores, hence the wide time cap.
SMOLLM2_WARM_START_STEPS = 24
SMOLLM2_WARM_START_LR = 2e-4
SMOLLM2_WARM_START_SECONDS = 3600.0

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr", "st",
           "th", "sh", "qu", "vr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "sk", "nd", "rn", "x"]


@dataclass(frozen=True)
class WorldConfig:
    """Sizes of the world. seed: everything (names, facts, split, question order)."""

    people: int = 128
    val_people: int = 32
    companies: int = 16
    cities: int = 12
    seed: int = 0
    task: str = "hops"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"demo world: task={self.task!r} is unknown; use one of {TASKS} (demo.task=...)")
        for name in ("people", "companies", "cities"):
            if getattr(self, name) < 2:
                raise ValueError(f"demo world: {name}={getattr(self, name)} must be >= 2")
        if not 1 <= self.val_people < self.people:
            raise ValueError(f"demo world: val_people={self.val_people} must be in [1, people={self.people})")


@dataclass(frozen=True)
class Question:
    kind: str          # employer | hq
    person: str
    question: str
    answer: str

    @property
    def hops(self) -> int:
        """Searches the question needs."""
        return {"employer": 1, "hq": 2, "mentor2": 2, "mentor3": 3}[self.kind]


@dataclass(frozen=True)
class World:
    employer: dict[str, str]      # person handle -> company tag
    hq: dict[str, str]            # company tag -> city
    cities: tuple[str, ...]
    val_names: frozenset[str]
    # The chain task only (empty otherwise): person -> another person, company -> a person.
    mentor: dict[str, str] = field(default_factory=dict)
    founder: dict[str, str] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return "chain" if self.mentor else "hops"

    def split(self, name: str) -> list[str]:
        """The training or the held-out validation people (handles)."""
        held_out = name == "val"
        return [p for p in self.employer if (p in self.val_names) == held_out]

    def questions(self, split: str) -> list[Question]:
        """Two questions per person of ``split``; on the chain task a three-search chain that comes back to the asked
        person (its third search would repeat the first, which the loop refuses as a duplicate) is left out."""
        out = []
        for person in self.split(split):
            if self.task == "chain":
                m1 = self.mentor[person]
                m2 = self.mentor[m1]
                answers = {"mentor2": m2, "mentor3": self.mentor[m2]}
                templates = {k: v for k, v in CHAIN_QUESTIONS.items() if k != "mentor3" or m2 != person}
            else:
                answers = {"employer": self.employer[person], "hq": self.hq[self.employer[person]]}
                templates = QUESTIONS
            out += [Question(kind, person, templates[kind].format(person=person), answers[kind])
                    for kind in templates]
        return out

    def chain(self, question: Question) -> list[str]:
        """The entities a chain question's searches must name, in order: the asked person, then each one's mentor
        (the last search's passage names the answer)."""
        path = [question.person]
        while len(path) < question.hops:
            path.append(self.mentor[path[-1]])
        return path

    def hop_targets(self, question: Question) -> list[str]:
        """The entities a correct trajectory searches, in order (the agent loop records which hops a trajectory got
        right against them: ``TurnRecord.hop_right``)."""
        if question.kind in CHAIN_QUESTIONS:
            return self.chain(question)
        return [question.person] + ([self.employer[question.person]] if question.kind == "hq" else [])

    def passages(self) -> list[dict]:
        """The world's corpus records, one per person and per company."""
        if self.task == "chain":  # every passage names two entities: the chain's next one and a distractor
            records = [{"id": f"world-p{i}", "contents": f'"{p}"\n{p} works for {c}. {p} is mentored by '
                                                         f'{self.mentor[p]}.'}
                       for i, (p, c) in enumerate(self.employer.items())]
            records += [{"id": f"world-c{i}", "contents": f'"{c}"\n{c} is headquartered in {city}. {c} was founded '
                                                          f'by {self.founder[c]}.'}
                        for i, (c, city) in enumerate(self.hq.items())]
            return records
        records = [{"id": f"world-p{i}", "contents": f'"{p}"\n{p} works for {c}.'}
                   for i, (p, c) in enumerate(self.employer.items())]
        records += [{"id": f"world-c{i}", "contents": f'"{c}"\n{c} is headquartered in {city}.'}
                    for i, (c, city) in enumerate(self.hq.items())]
        return records

    def vocabulary(self) -> list[str]:
        """Whole tokens of the demo tokenizer: every handle, tag and city."""
        return list(self.employer) + list(self.hq) + list(self.cities)


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

    def fresh() -> str:
        while True:
            name = _word(rng, 2)
            if name.lower() not in used:
                used.add(name.lower())
                return name

    cities = tuple(fresh() for _ in range(config.cities))
    hq = {COMPANY_MARK + fresh(): rng.choice(cities) for _ in range(config.companies)}
    employer = {PERSON_MARK + fresh(): rng.choice(list(hq)) for _ in range(config.people)}
    val = rng.sample(list(employer), config.val_people)
    world = World(employer, hq, cities, frozenset(val))
    return _with_chain(world, rng) if config.task == "chain" else world


def _with_chain(world: World, rng: random.Random) -> World:
    """The chain task's extra facts, drawn after the shared ones (so the names and the hops world stay the same):
    each person's mentor (another person), each company's founder."""
    people = list(world.employer)
    mentor = {p: rng.choice([q for q in people if q != p]) for p in people}
    founder = {c: rng.choice(people) for c in world.hq}
    return replace(world, mentor=mentor, founder=founder)


def practice_world(world: World, seed: int) -> World:
    """The same names with facts drawn anew (``seed``) and every person in training: what the warm-start plays."""
    rng = random.Random(seed + PRACTICE_SEED_OFFSET)
    hq = {company: rng.choice(world.cities) for company in world.hq}
    employer = {person: rng.choice(list(hq)) for person in world.employer}
    practice = replace(world, employer=employer, hq=hq, val_names=frozenset())
    if world.task == "chain":
        practice = _with_chain(replace(practice, mentor={}, founder={}), rng)
    return practice


@dataclass(frozen=True)
class PlannedTrajectory:
    """What the warm-start policy does for one question: the search queries in order, then the answer."""

    queries: tuple[str, ...]
    answer: str


def warm_start_plan(world: World, question: Question, rng: random.Random, *, p_no_search: float = 0.6,
                    p_second_hop: float = 0.3,
                    chain: tuple[float, float] = (CHAIN_P_NO_SEARCH, CHAIN_P_NEXT_HOP)) -> PlannedTrajectory:
    """One trajectory of the imperfect policy the demo model is warm-started into.

    It answers at once with probability ``p_no_search``, with a random entity of the asked kind (so the position
    after the prompt is an answering position too, and information gain is not just "answering after an
    observation"); otherwise it searches the asked person and, for a one-hop question, answers the company it read.
    For a two-hop question it searches that company with probability ``p_second_hop`` and answers its city;
    otherwise it answers right after the first observation with a random city. A chain question is played by
    ``chain_plan`` with ``chain`` = (p_no_search, p_next_hop).
    """
    if question.kind in CHAIN_QUESTIONS:
        return chain_plan(world, question, rng, p_no_search=chain[0], p_next_hop=chain[1])
    if rng.random() < p_no_search:
        pool = list(world.hq) if question.kind == "employer" else list(world.cities)
        return PlannedTrajectory((), rng.choice(pool))
    company = world.employer[question.person]
    if question.kind == "employer":
        return PlannedTrajectory((question.person,), company)
    if rng.random() < p_second_hop:
        return PlannedTrajectory((question.person, company), world.hq[company])
    return PlannedTrajectory((question.person,), rng.choice(world.cities))


def chain_plan(world: World, question: Question, rng: random.Random, *, p_no_search: float = CHAIN_P_NO_SEARCH,
               p_next_hop: float = CHAIN_P_NEXT_HOP) -> PlannedTrajectory:
    """The warm-start policy on a chain question: it knows the protocol (search a name it read, copy a name into the
    answer) but often stops before a chain's end. It answers at once with a random person with probability
    ``p_no_search``; otherwise it searches the asked person, then takes each next hop with probability ``p_next_hop``
    (searching the mentor the last passage named), and answers the mentor its last passage named when the chain is
    complete, else a random person. A complete chain: (1 - p_no_search) * p_next_hop^(hops - 1) of its plans."""
    people = list(world.employer)
    if rng.random() < p_no_search:
        return PlannedTrajectory((), rng.choice(people))
    path = world.chain(question)
    queries = [path[0]]
    while len(queries) < len(path) and rng.random() < p_next_hop:
        queries.append(path[len(queries)])
    if len(queries) == len(path):
        return PlannedTrajectory(tuple(queries), question.answer)
    return PlannedTrajectory(tuple(queries), rng.choice(people))


def warm_start_config(max_steps: int | None = None, task: str = "hops", model: str = "tiny") -> WarmStartConfig:
    """The warm-start's knobs for the demo model: the demo's agent settings (of ``task``); with ``model="smollm2"``
    the real model's (one- and two-hop questions only)."""
    if model not in MODELS:
        raise ValueError(f"demo world: model={model!r} is unknown; use one of {MODELS} (demo.model=...)")
    if model == "smollm2":
        if task != "hops":
            raise ValueError(f"demo world: the real model (demo.model=smollm2) plays task=hops only, not {task!r}")
        return WarmStartConfig(seconds=SMOLLM2_WARM_START_SECONDS, max_steps=max_steps or SMOLLM2_WARM_START_STEPS,
                               lr=SMOLLM2_WARM_START_LR, warmup_steps=3, max_turns=MAX_TURNS,
                               max_tokens_per_turn=SMOLLM2_MAX_TOKENS_PER_TURN,
                               max_observation_tokens=SMOLLM2_MAX_OBSERVATION_TOKENS, prompt_length=PROMPT_LENGTH,
                               response_length=SMOLLM2_RESPONSE_LENGTH, system_prompt=SYSTEM_PROMPT,
                               tool_names=("search",), topk=TOPK, examples_per_passage=WARM_START_PLANS)
    chain = task == "chain"
    return WarmStartConfig(max_steps=max_steps or WARM_START_STEPS, lr=WARM_START_LR,
                           max_turns=CHAIN_MAX_TURNS if chain else MAX_TURNS,
                           max_tokens_per_turn=MAX_TOKENS_PER_TURN, max_observation_tokens=MAX_OBSERVATION_TOKENS,
                           prompt_length=PROMPT_LENGTH, response_length=CHAIN_RESPONSE_LENGTH if chain else RESPONSE_LENGTH,
                           system_prompt=SYSTEM_PROMPT,
                           tool_names=("search",), topk=TOPK, examples_per_passage=WARM_START_PLANS)


def to_table(questions: list[Question], split: str, world: World):
    """verl RL rows (the schema of data/train_nq_256.parquet, with the question's chain in ``extra_info.hop_targets``:
    the entities a correct trajectory searches, in order) as a pyarrow table."""
    import pyarrow as pa

    from igpo.demo.titles import parquet_schema

    base = parquet_schema()
    info = base.field("extra_info").type
    schema = base.set(base.get_field_index("extra_info"), pa.field("extra_info", pa.struct(
        list(info) + [pa.field(HOP_TARGETS_KEY, pa.list_(pa.string()))])))
    rows = [{
        "data_source": f"{DATA_SOURCE}_{q.kind}",
        "prompt": [{"content": q.question, "role": "user"}],
        "ability": ABILITY,
        "reward_model": {"ground_truth": q.answer, "style": "rule"},
        "extra_info": {"index": f"{DATA_SOURCE}_{q.kind}_{q.person}", "split": split,
                       HOP_TARGETS_KEY: world.hop_targets(q)},
    } for q in questions]
    return pa.Table.from_pylist(rows, schema=schema)


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` only if it differs, through a rename: a run that already reads the file (another
    launch in the same checkout, its tool server holding the corpus open) never sees it half-written or changed."""
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_corpus(path: Path, base: str, world: World) -> None:
    """Base passages + the world's, then check that every handle and tag retrieves its own passage first."""
    import asyncio

    from tool_server.backends.local import LocalBackend

    _replace(path, (base + "\n" + "\n".join(json.dumps(r) for r in world.passages()) + "\n").encode("utf-8"))
    backend = LocalBackend(path)
    titles = {record["id"]: record["contents"].split("\n")[0].strip('"') for record in world.passages()}

    async def misses() -> list[str]:
        out = []
        for name in list(world.employer) + list(world.hq):
            hits = await backend.search_one(name, 1, deadline=float("inf"))
            if not hits or titles.get(hits[0].doc_id) != name:
                out.append(name)
        return out

    missed = asyncio.run(misses())
    if missed:
        raise ValueError(f"demo world: searching {missed[:5]} does not rank their own passage first in {path}; "
                         "change WorldConfig.seed")


def write_world(out_dir: str | Path, base_corpus: str | Path, config: WorldConfig = WorldConfig()) -> dict[str, Path]:
    """Write the demo's files to ``out_dir``: ``corpus.jsonl`` (base corpus + the world), ``train.parquet`` and
    ``val.parquet`` (its questions), ``practice_corpus.jsonl`` (base corpus + the practice world the warm-start
    plays) and ``vocabulary.txt`` (the tokens the demo tokenizer adds, one per line)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    world = build_world(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = Path(base_corpus).read_text(encoding="utf-8").rstrip("\n")
    paths = {"corpus": out_dir / "corpus.jsonl", "practice_corpus": out_dir / "practice_corpus.jsonl",
             "vocabulary": out_dir / "vocabulary.txt"}
    _write_corpus(paths["corpus"], base, world)
    _write_corpus(paths["practice_corpus"], base, practice_world(world, config.seed))
    _replace(paths["vocabulary"], ("\n".join(world.vocabulary()) + "\n").encode("utf-8"))
    for split in ("train", "val"):
        questions = world.questions(split)
        random.Random(f"{config.seed}:{split}").shuffle(questions)
        paths[split] = out_dir / f"{split}.parquet"
        buffer = pa.BufferOutputStream()
        pq.write_table(to_table(questions, split, world), buffer)
        _replace(paths[split], buffer.getvalue().to_pybytes())
    return paths


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True, help="directory for the demo's corpus, questions and vocabulary")
    parser.add_argument("--base-corpus", required=True, help="real passages kept as distractors, e.g. "
                                                             "data/wiki_passages_1000.jsonl")
    parser.add_argument("--seed", type=int, default=WorldConfig.seed)
    parser.add_argument("--task", choices=TASKS, default=WorldConfig.task,
                        help="hops: one- and two-hop questions; chain: two- and three-search chains (demo.task=chain)")
    args = parser.parse_args()
    for path in write_world(args.out_dir, args.base_corpus, WorldConfig(seed=args.seed, task=args.task)).values():
        print(path)


if __name__ == "__main__":
    main()
