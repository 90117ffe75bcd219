"""What the agent loop records about each trajectory, typed: written once into verl's ``extra_fields`` and read back
by the trainer, the methods, the reward, the evaluation and the demo through these classes only (the string keys
live here and nowhere else).

``TurnRecord`` is one trajectory (per turn: where it ended, the tool it called and how that went, its format; in
all: counters and flags for the rollout metrics); ``BranchRecord`` is its place in an ARPO tree (the ``arpo_agent``
loop only). ``TurnBatch`` is a training batch of them as [B, T] tensors, the turns cut by the response length
dropped: what a method reads; its ``TreeBatch`` holds the batch's ARPO tree, decoded once per step. ``RewardInputs``
is what the outcome reward reads of a sample's ``extra_info``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from igpo.agent import HOP_TARGETS_KEY
from igpo.core.advantage import group_ids
from igpo.core.info_gain import reduce_alias_logprobs

# Keys verl's agent loop expects in every output's extra_fields besides ours (verl concatenates them across samples).
VERL_KEYS = ("min_global_steps", "max_global_steps", "turn_scores", "tool_rewards")


@dataclass
class BranchRecord:
    """A trajectory's place in its ARPO tree: ``index`` (its number in the prompt's group of M), ``parent`` (the
    trajectory it branched from, −1 for a root), ``branch_pos`` (response tokens shared with the parent), whether it
    is a top-up sample, the entropy it started from and the ΔH of each turn it measured."""

    index: int = 0
    parent: int = -1
    branch_pos: int = 0
    is_topup: bool = False
    h_init: float | None = None
    delta_h: list[float] = field(default_factory=list)
    unmeasured: int = 0
    rounds: int = 0
    prompt: str = ""

    def to_extra_fields(self) -> dict[str, Any]:
        return {f"arpo_{name}": _copy(value) for name, value in dataclasses.asdict(self).items()}


@dataclass
class TurnRecord:
    """One trajectory as the agent loop saw it. Per turn j (lists of the trajectory's turn count unless said):
    ``turn_ends`` (its last generated response token), ``boundaries`` (context length before it: where the answer
    probe of IG is scored), ``tool_names`` (None for an answer or malformed turn), ``tool_status`` (ok, no_results,
    bad_request, infra_error, answer, ...), ``format_ok``, ``answer_logprobs`` (per boundary, per gold alias, when
    the rollout scored), ``answer_seen`` (per shown observation: it held a gold alias; empty without ground truth),
    ``hop_right`` (per turn, when the sample names its chain's entities (``hop_targets``): the turn is a tool call that
    named the chain's next entity not reached yet, i.e. it made the next correct hop; False for a wrong hop, an
    answer or a malformed turn; empty without targets). The k-th True is the chain's hop k; ``sum(hop_right)`` hops
    were reached, of ``hop_total`` (the chain's length; 0 without targets). ``turn_versions`` (per turn, ``[first, last]``: the weight versions, verl's global step of the
    last update the rollout engine had loaded, that generated it; two differ when an asynchronous trainer paused the
    generation for an update and resumed it on the new weights; None when the engine reports no version)."""

    turn_ends: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    tool_names: list[str | None] = field(default_factory=list)
    tool_status: list[str] = field(default_factory=list)
    format_ok: list[bool] = field(default_factory=list)
    answer_logprobs: list[list[float] | None] = field(default_factory=list)
    answer_seen: list[bool] = field(default_factory=list)
    hop_right: list[bool] = field(default_factory=list)
    hop_total: int = 0
    turn_versions: list[list[int] | None] = field(default_factory=list)
    infra_errors: int = 0
    forced_final: bool = False
    cutoff: bool = False
    truncated: bool = False
    retries: int = 0
    final_turn_text: str = ""
    final_answer: str | None = None
    stop_reason: str = "none"
    eos_appended: int = 0
    empty_turns: int = 0
    scoring_errors: int = 0
    context_overflow: bool = False
    error: str | None = None
    question: str = ""
    branch: BranchRecord | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turn_ends)

    def to_extra_fields(self) -> dict[str, Any]:
        """The record as verl's ``extra_fields`` (plain lists and scalars, the same keys in every output)."""
        fields = {_KEY[f.name]: _copy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "branch"}
        fields["igpo_num_turns"] = self.num_turns
        if self.branch is not None:
            fields.update(self.branch.to_extra_fields())
        return fields

    @classmethod
    def from_extra_fields(cls, fields: Mapping[str, Any] | None) -> "TurnRecord":
        """Read a record back (anything that is not a mapping, or a missing key: the field's default)."""
        fields = fields if isinstance(fields, Mapping) else {}
        values = {}
        for f in dataclasses.fields(cls):
            if f.name == "branch":
                continue
            value = fields.get(_KEY[f.name])
            if value is not None:
                values[f.name] = list(value) if isinstance(f.default_factory, type) else value
        # The turn count is the record's own: lists longer than it (an older loop) are cut, no count means no turns.
        num_turns = int(fields.get("igpo_num_turns") or 0)
        for name in ("turn_ends", "boundaries", "tool_names", "tool_status", "format_ok", "answer_logprobs",
                     "hop_right", "turn_versions"):
            values[name] = values.get(name, [])[:num_turns]
        if "arpo_parent" in fields:
            values["branch"] = BranchRecord(**{
                name: fields[f"arpo_{name}"] for name in _BRANCH_FIELDS if fields.get(f"arpo_{name}") is not None})
        return cls(**values)


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


_BRANCH_FIELDS = tuple(f.name for f in dataclasses.fields(BranchRecord))
_KEY = {f.name: f"igpo_{f.name}" for f in dataclasses.fields(TurnRecord)}
_KEY["format_ok"] = "igpo_turn_format_ok"
EXTRA_FIELD_KEYS = tuple(key for name, key in _KEY.items() if name != "branch") + ("igpo_num_turns",) + VERL_KEYS
"""Keys present in EVERY ``igpo_agent`` output's ``extra_fields``."""
BRANCH_FIELD_KEYS = tuple(f"arpo_{name}" for name in _BRANCH_FIELDS)
"""Keys every ``arpo_agent`` output carries besides."""
# The question as the dataset states it: verl's extra_info of a sample, read when the loop recorded none.
_QUESTION_KEYS = (_KEY["question"], "question")
# An optional key a caller may set to say the generation prompt ended with <think> (no loop writes it).
_THINK_PREFILLED_KEY = "igpo_think_prefilled"


def hop_targets(extra_info: Mapping[str, Any] | None) -> list[str]:
    """The entities a sample's correct chain searches, in order (``extra_info["hop_targets"]``, written by the demo
    world, igpo/demo/world.py); [] when the dataset names none."""
    targets = extra_info.get(HOP_TARGETS_KEY) if isinstance(extra_info, Mapping) else None
    if targets is None:
        return []
    if isinstance(targets, str) or not all(isinstance(t, str) and t for t in targets):
        raise TypeError(f"extra_info[{HOP_TARGETS_KEY!r}] must be a list of non-empty strings (the chain's entities "
                        f"in search order); got {targets!r}")
    return list(targets)


@dataclass
class TurnBatch:
    """A batch of records as tensors: ``num_turns`` [B] (turns whose end lies beyond the stored response, cut by
    ``rollout.response_length``, dropped: their reward would have no token to sit on), ``turn_ends`` and
    ``format_ok`` [B, T] (T = the batch's largest kept turn count, at least 1), ``tool_names`` / ``tool_status``
    per row (kept turns only), ``infra_failed`` [B, T] (the turn's tool call failed for infrastructure reasons),
    ``answer_seen`` / ``answer_known`` [B, T]; ``hop_right`` [B, T] (the turn made its chain's next correct hop),
    ``hop_known`` [B] (the row's sample named its chain: ``hop_right`` means something) and ``hop_total`` [B] (its
    chain's length, 0 where unknown); ``tree``: the rows' ARPO tree records."""

    records: list[TurnRecord]
    num_turns: Tensor
    turn_ends: Tensor
    format_ok: Tensor
    tool_names: list[list[str | None]]
    tool_status: list[list[str]]
    infra_failed: Tensor
    answer_seen: Tensor
    answer_known: Tensor
    hop_right: Tensor
    hop_known: Tensor
    tree: TreeBatch
    hop_total: Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.turn_ends.shape[1])

    @classmethod
    def from_records(cls, records: Sequence[TurnRecord], length: int) -> "TurnBatch":
        records = list(records)
        kept = []
        for r in records:
            # An end of -1 is an empty first turn recorded by an older loop: its end-of-turn token is response token 0.
            ends = [max(int(end), 0) for end in r.turn_ends]
            inside = [end < length for end in ends]
            kept.append(ends if all(inside) else ends[:inside.index(False)])
        B, T = len(records), max(1, max((len(e) for e in kept), default=0))
        num_turns = torch.tensor([len(e) for e in kept], dtype=torch.long)
        turn_ends = torch.zeros(B, T, dtype=torch.long)
        format_ok = torch.ones(B, T, dtype=torch.bool)
        infra_failed = torch.zeros(B, T, dtype=torch.bool)
        seen = torch.zeros(B, T, dtype=torch.bool)
        known = torch.zeros(B, T, dtype=torch.bool)
        hop_right = torch.zeros(B, T, dtype=torch.bool)
        hop_known = torch.tensor([bool(r.hop_right) for r in records], dtype=torch.bool)
        tool_names, tool_status = [], []
        for i, (r, ends) in enumerate(zip(records, kept)):
            n = len(ends)
            names = (r.tool_names or [None] * n)[:n]
            tool_names.append(names)
            tool_status.append(list(r.tool_status)[:len(names)])
            for t, status in enumerate(list(r.tool_status)[:T]):
                infra_failed[i, t] = status == "infra_error"
            if not n:
                continue
            turn_ends[i, :n] = torch.tensor(ends)
            format_ok[i, :n] = torch.tensor([bool(v) for v in (r.format_ok or [True] * n)[:n]])
            flags = [bool(v) for v in r.answer_seen[:n]]
            if flags:
                seen[i, :len(flags)] = torch.tensor(flags)
                known[i, :len(flags)] = True
            hops = [bool(v) for v in r.hop_right[:n]]
            if hops:
                hop_right[i, :len(hops)] = torch.tensor(hops)
        hop_total = torch.tensor([int(r.hop_total or 0) if r.hop_right else 0 for r in records], dtype=torch.long)
        return cls(records, num_turns, turn_ends, format_ok, tool_names, tool_status, infra_failed, seen, known,
                   hop_right, hop_known, TreeBatch.from_records(records), hop_total)

    def answer_logprobs(self, alias_mode: str) -> Tensor:
        """[B, T] float64: the rollout's log-probability of the gold answer at each kept turn's boundary, its aliases
        reduced by ``alias_mode`` (NaN where the rollout did not score)."""
        B, T = self.turn_ends.shape
        aliases = max([len(entry) for r in self.records for entry in r.answer_logprobs if entry], default=1)
        alias_lp = torch.full((B, T, aliases), float("nan"), dtype=torch.float64)
        alias_ok = torch.zeros(B, aliases, dtype=torch.bool)
        for i, r in enumerate(self.records):
            for s, entry in enumerate(r.answer_logprobs[:int(self.num_turns[i])]):
                if entry:
                    alias_lp[i, s, :len(entry)] = torch.tensor([float(v) for v in entry], dtype=torch.float64)
                    alias_ok[i, :len(entry)] = True
        return reduce_alias_logprobs(alias_lp, alias_ok, alias_mode)

    def branch_meta(self) -> dict[str, Tensor]:
        """``index``, ``parent``, ``branch_pos`` [B] of the ARPO tree (a row without a branch record is a root)."""
        return {"index": self.tree.index, "parent": self.tree.parent, "branch_pos": self.tree.branch_pos}


@dataclass
class TreeBatch:
    """The ``BranchRecord`` of every row of a batch as [B] tensors: ``recorded`` (bool: the arpo_agent loop wrote
    one), ``group`` (dense ids of the prompt each row branched in), ``index``, ``parent``, ``branch_pos``,
    ``is_topup`` (bool), ``unmeasured`` (turns whose ΔH could not be measured); ``delta_h``: per row, the ΔH of each
    turn it measured. A row without a record reads as a root: index 0, parent −1, branch position 0."""

    recorded: Tensor
    group: Tensor
    index: Tensor
    parent: Tensor
    branch_pos: Tensor
    is_topup: Tensor
    unmeasured: Tensor
    delta_h: list[list[float]]

    @classmethod
    def from_records(cls, records: Sequence[TurnRecord]) -> "TreeBatch":
        root = BranchRecord()
        branches = [r.branch or root for r in records]

        def column(values, dtype=torch.long) -> Tensor:
            return torch.tensor(list(values), dtype=dtype)

        return cls(
            recorded=column((r.branch is not None for r in records), torch.bool),
            group=group_ids([b.prompt for b in branches]) if branches else column(()),
            index=column(int(b.index) for b in branches),
            parent=column(int(b.parent) for b in branches),
            branch_pos=column(int(b.branch_pos) for b in branches),
            is_topup=column((bool(b.is_topup) for b in branches), torch.bool),
            unmeasured=column(int(b.unmeasured or 0) for b in branches),
            delta_h=[[float(d) for d in (b.delta_h or [])] for b in branches],
        )


@dataclass(frozen=True)
class RewardInputs:
    """What the outcome reward reads of a sample's ``extra_info`` (verl hands the reward function the agent loop's
    extra fields there): ``final_turn_text``, the final assistant turn (None when no igpo loop wrote the sample: the
    reward then parses the response); ``question``, the question shown to the judge (the loop's record, else the
    dataset's ``question``, else ""); ``think_prefilled``, whether the generation prompt ended with ``<think>``
    (None: the reward's own setting decides)."""

    final_turn_text: str | None = None
    question: str = ""
    think_prefilled: bool | None = None

    @classmethod
    def from_extra_info(cls, info: Mapping[str, Any] | None) -> "RewardInputs":
        info = info if isinstance(info, Mapping) else {}
        turn = info.get(_KEY["final_turn_text"])
        if turn is not None and not isinstance(turn, str):
            raise TypeError(f"extra_info[{_KEY['final_turn_text']!r}] is a {type(turn).__name__}; the agent loop must "
                            "store a str.")
        question = next((value for value in (info.get(key) for key in _QUESTION_KEYS)
                         if isinstance(value, str) and value.strip()), "")
        think = bool(info[_THINK_PREFILLED_KEY]) if _THINK_PREFILLED_KEY in info else None
        return cls(turn, question, think)

    def to_extra_info(self) -> dict[str, Any]:
        """The ``extra_info`` a caller of the reward function passes for a trajectory it holds itself."""
        info: dict[str, Any] = {_KEY["question"]: self.question}
        if self.final_turn_text is not None:
            info[_KEY["final_turn_text"]] = self.final_turn_text
        if self.think_prefilled is not None:
            info[_THINK_PREFILLED_KEY] = self.think_prefilled
        return info
