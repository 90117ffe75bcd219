"""The golden reference for information gain with a real model, written without ``igpo.core.scoring`` or
``build_probe``: one plain ``AutoModelForCausalLM`` forward per (boundary, probe) over the exact token ids, the answer
span found by decoding token prefixes (not by the tokenizer's offsets), IG by the recurrence of
igpo/core/info_gain.py written as a loop. Used by tests/integration/test_real_model_ig.py (trajectories through our
HF rollout server) and tests/e2e/test_e2e_real_model.py (through verl's vLLM rollout in the real trainer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from igpo.agent.records import TurnRecord
from igpo.core.ground_truth import AnswerTemplate, build_probe
from igpo.core.info_gain import InfoGainConfig, scored_boundaries, turn_information_gain
from igpo.core.scoring import ScoringConfig, score_answer_logprobs

TOL = 1e-4
EOT = "<|im_end|>"
# (name, prefix, suffix, answer or None for the question's own): the probes scored after every boundary.
PROBES = (
    ("demo", "<answer>", "</answer>", None),                # the demo's template; a multi-token name
    ("merge", "<answer>", "</answer>", '"Vesk"'),           # `>"` is one token: the span starts inside the prefix
    ("space", "<answer> ", "</answer>", None),              # `Ġ#` / `ĠV`: the answer's first token holds the space
)


@dataclass
class Trajectory:
    """What the comparison needs of one trajectory: the gold answer, the exact ids and the loop's turn record (its
    ``answer_logprobs``: the demo probe as the rollout engine scored it)."""

    answer: str
    prompt_ids: list[int]
    response_ids: list[int]
    record: TurnRecord

    @property
    def ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)


def span_by_decoding(tokenizer, ids: list[int], prefix: str, answer: str) -> tuple[int, int]:
    """[gs, ge): the tokens whose decoded characters overlap the answer's, found from the lengths of decoded
    prefixes (byte-level BPE decodes exactly, so decode(ids[:k]) is the first characters of the text)."""
    a0, a1 = len(prefix), len(prefix) + len(answer)
    ends = [len(tokenizer.decode(ids[:k + 1])) for k in range(len(ids))]
    starts = [0] + ends[:-1]
    inside = [k for k in range(len(ids)) if starts[k] < a1 and ends[k] > a0]
    return inside[0], inside[-1] + 1


@torch.no_grad()
def reference_logprob(model, context: list[int], probe_ids: list[int], span: tuple[int, int]) -> float:
    """mean_{j in span} log p(probe[j] | context, probe[:j]): one full forward, every position's distribution."""
    ids = torch.tensor([context + probe_ids])
    logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    b = len(context)
    return sum(float(logp[b + j - 1, probe_ids[j]]) for j in range(*span)) / (span[1] - span[0])


def reference_ig(values: list[float], scored: list[bool]) -> list[float | None]:
    """IG_j = v_{j+1} - v_prev (log_prob_diff), v_prev the last scored boundary's value; None: turn has no IG."""
    out, previous = [], values[0]
    for s in range(1, len(values)):
        if scored[s]:
            out.append(values[s] - previous)
            previous = values[s]
        else:
            out.append(None)
    return out


def probes_for(tokenizer, answer: str):
    """(name, our Probe, the reference's (ids, span)) for every case of PROBES."""
    out = []
    for name, prefix, suffix, fixed in PROBES:
        gold = fixed or answer
        ours = build_probe(tokenizer, gold, AnswerTemplate(prefix, suffix + EOT))
        ids = tokenizer.encode(prefix + gold + suffix + EOT, add_special_tokens=False)
        out.append((name, ours, (ids, span_by_decoding(tokenizer, ids, prefix, gold))))
    return out


def worst_differences(tokenizer, model, trajectories: list[Trajectory]) -> tuple[dict[str, float], int]:
    """Max |ours - reference| over every boundary and probe, for the actor-side packed scorer (fp32), the rollout's
    own scores of the demo probe, and IG through igpo.core.info_gain (ig_turns all and reached); and the number of
    boundaries checked. Raises when a turn's IG mask disagrees with the reference's."""
    worst = {"packed": 0.0, "rollout": 0.0, "ig": 0.0}
    boundaries = 0
    for trajectory in trajectories:
        record, ids = trajectory.record, trajectory.ids
        cases = probes_for(tokenizer, trajectory.answer)
        golden = [[reference_logprob(model, ids[:b], ref_ids, ref_span) for _, _, (ref_ids, ref_span) in cases]
                  for b in record.boundaries]
        packed = score_answer_logprobs(model, torch.tensor(ids), record.boundaries, [ours for _, ours, _ in cases],
                                       ScoringConfig(strategy="packed"))
        worst["packed"] = max(worst["packed"], float((packed.double() - torch.tensor(golden)).abs().max()))
        if not all(row is not None for row in record.answer_logprobs):
            raise AssertionError(f"a boundary the rollout did not score: {record.answer_logprobs}")
        rollout = [row[0] for row in record.answer_logprobs]
        worst["rollout"] = max(worst["rollout"], max(abs(r - g[0]) for r, g in zip(rollout, golden)))
        boundaries += len(record.boundaries)
        for mode in ("all", "reached"):
            cfg = InfoGainConfig(ig_turns=mode)
            scored = scored_boundaries([record.tool_names], cfg, [record.tool_status])[0]
            for p in range(len(cases)):
                ig, mask, _ = turn_information_gain(packed[:, p][None].double(), torch.tensor([scored]),
                                                    torch.tensor([record.num_turns]), cfg)
                expected = reference_ig([g[p] for g in golden], scored)
                if mask[0].tolist() != [e is not None for e in expected]:
                    raise AssertionError(f"IG mask {mask[0].tolist()} vs the reference's {expected}")
                for j, e in enumerate(expected):
                    if e is not None:
                        worst["ig"] = max(worst["ig"], abs(float(ig[0, j]) - e))
    return worst, boundaries
