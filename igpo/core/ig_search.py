"""IG-Search's turn reward (docs/methods/ig_search.md): what a search result told the policy about the gold answer,
measured against a random document shown in its place.

For tool turn j of a trajectory, with c_{j+1} the context through turn j's observation (boundary j + 1) and c̃_{j+1}
the same context with the observation's content replaced by a random document d (its chat template kept),

    ℓ(c) = (1/|G|) Σ_{k∈G} log π_old(y_k | c, y_<k)        (the answer probe's gold tokens G, as IGPO scores them)
    g_j  = ℓ(c_{j+1}) − ℓ(c̃_{j+1})

Both copies are scored in one paired pass after the shared prefix (the context before the observation's content),
so a document equal to the real content gives exactly g_j = 0. Here the random documents are the contents of the
observations that trajectories of *other* prompt groups received in the same step (``draw_documents``): real
results of the same tool, in the same format and length range, about another question.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from igpo.core.ground_truth import Probe
from igpo.core.sections import section_values


@dataclass(frozen=True)
class IGSearchConfig:
    """``algorithm.ig_search``.

    seed: the random documents of step t are drawn with a generator seeded from (seed, t): a run is repeatable, and
        two steps draw differently.
    """

    seed: int = 0

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"algorithm.ig_search.seed={self.seed!r} must be an integer >= 0 (the run's seed by "
                             "default: configs/igpo_base.yaml).")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "IGSearchConfig":
        """From the ``algorithm.ig_search`` mapping; unknown keys raise with the known ones, None keeps a default."""
        return cls(**section_values(cls, section, "ig_search"))


def draw_documents(wanted: Sequence[tuple[int, Hashable]], donors: Sequence[int], seed: int,
                   step: int) -> list[int | None]:
    """For each turn to measure, the index of its random document among ``donors``.

    ``wanted[m] = (group, key)``: the prompt group of the m-th turn to measure and a key of what the turn holds (the
    caller's: its context through the observation); ``donors[d]``: the prompt group of the d-th document (an
    observation's content). A turn gets a document of another group, uniformly, drawn with a generator seeded from
    (``seed``, ``step``) in order of the keys' first appearance; turns with equal keys get the same document, so the
    copies of a turn that ARPO branches share get the same gain. None where no other group has a document (the turn
    cannot be measured)."""
    generator = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    groups = torch.as_tensor(list(donors), dtype=torch.long)
    drawn: dict[tuple[int, Hashable], int | None] = {}
    out: list[int | None] = []
    for group, key in wanted:
        if (group, key) not in drawn:
            others = torch.nonzero(groups != int(group)).flatten()
            drawn[group, key] = (int(others[int(torch.randint(others.numel(), (1,), generator=generator))])
                                 if others.numel() else None)
        out.append(drawn[group, key])
    return out


def paired_copies(ids: Sequence[int], content: tuple[int, int], boundary: int, document: Sequence[int],
                  probe: Probe) -> tuple[tuple[list[int], tuple[int, int]], tuple[list[int], tuple[int, int]]]:
    """The two continuations of one (turn, probe), each fed after ``ids[:content[0]]``, with the probe's gold span
    inside it: factual ``ids[cs:boundary] + probe`` and counterfactual ``document + ids[ce:boundary] + probe`` (the
    observation's content [cs, ce) replaced, the template tokens after it up to the boundary kept)."""
    cs, ce = content
    if not 0 < cs <= ce <= boundary <= len(ids):
        raise ValueError(f"observation content {content} and boundary {boundary} are not ordered inside the "
                         f"trajectory of {len(ids)} tokens")
    gs, ge = probe.span
    factual = list(ids[cs:boundary])
    counterfactual = list(document) + list(ids[ce:boundary])
    return ((factual + list(probe.token_ids), (len(factual) + gs, len(factual) + ge)),
            (counterfactual + list(probe.token_ids), (len(counterfactual) + gs, len(counterfactual) + ge)))
