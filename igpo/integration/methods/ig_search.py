"""IG-Search (``algorithm.adv_estimator=ig_search``; docs/methods/ig_search.md): a search turn is credited with how
much its result raised the gold answer's log-probability over a random document in the result's place
(``igpo.core.ig_search``), in IGPO's pipeline in place of IGPO's information gain: ``IGSearchMethod`` overrides only
``turn_gains``; format penalty, warm-up gate, curriculum, infrastructure masking, ARPO pool weights, normalisation and
discounting are IGPO's, read from ``algorithm.igpo``.

The turns measured are those IGPO would score (``algorithm.igpo``'s tool filter, ``ig_compute_freq``, ``ig_turns``);
each is measured on its own (no telescoping: the gain compares two observations, not two boundaries). The actor
scores, per measured turn and answer alias, a factual and a counterfactual copy of the context after the
observation's content starts (``scorer.score_counterfactuals``, InfoPO's paired pass, at the rollout's temperature).
A turn that cannot be measured (no document of another prompt group in the step, no content span, the copy past the
context window, a non-finite score) gets no reward position and is counted (``ig_search/unmeasured_turns``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from igpo.agent.agent_config import plain_section
from igpo.core.ground_truth import answer_probes
from igpo.core.health import REACHED_STATUSES
from igpo.core.ig_search import IGSearchConfig, draw_documents, paired_copies
from igpo.core.info_gain import reduce_alias_logprobs
from igpo.core.infopo import observation_content_span
from igpo.integration.methods.base import StepBatch, register_method
from igpo.integration.methods.igpo import IGPOMethod, TurnGains

logger = logging.getLogger(__name__)


@register_method("ig_search")
class IGSearchMethod(IGPOMethod):
    name = "ig_search"
    title = "IG-Search (information gain of a search result over a random document)"

    def __init__(self, config: Any):
        super().__init__(config)
        self.ig_search = IGSearchConfig.from_dict(plain_section(config.algorithm.get("ig_search", None)))
        # Settings of IGPO's answer scoring that IG-Search cannot honour: refused, not ignored.
        self.refuse_rollout_scoring_and_prob_diff(
            "both copies of a turn must be scored in the actor's one paired pass (the rollout's boundary scores are "
            "not read); set algorithm.igpo.score_on=actor and verify_scoring=false (the defaults).",
            "IG-Search's gain is a difference of answer log-probabilities; remove the key (log_prob_diff is the "
            "default).")
        self.fields = ("prompts", "responses", "reward_model")

    def turn_gains(self, batch: StepBatch, scorer: Any, metrics: dict) -> TurnGains:
        """g_j = ℓ(real observation) − ℓ(random document in its place) for the measured turns (module docstring)."""
        started = time.perf_counter()
        turns, infra, cfg = batch.turns, batch.infra, self.igpo
        prompts, responses = batch.fields["prompts"], batch.fields["responses"]
        reward_models = batch.fields["reward_model"]
        frame = scorer.frame
        suffixes = list(frame.suffix_ids.values())
        B, T = turns.turn_ends.shape
        scored = self.scored_boundaries(batch)
        sequences, contents, donors, wanted, keys = [], {}, [], [], []
        unmeasured = {"no_content": 0, "no_span": 0, "no_document": 0, "too_long": 0, "not_finite": 0}
        for i, record in enumerate(turns.records):
            n, P = int(turns.num_turns[i]), int(prompts[i].numel())
            sequence = torch.cat([prompts[i], responses[i]])
            ids = sequence.tolist()
            sequences.append(ids)
            # A turn's key is a digest of its context through the observation (ARPO copies of a turn share it), kept
            # as a running hash over the row: every prefix is hashed once.
            context, hashed = hashlib.blake2b(digest_size=16), 0
            for j in range(min(n - 1, len(record.boundaries) - 1)):
                # A turn the infra policy masked carries no reward: not measured (its result may still be a document).
                measure = bool(scored[i, j + 1]) and not bool(infra.rows[i] or infra.turns[i, j])
                after_action, boundary = int(turns.turn_ends[i, j]) + P + 1, int(record.boundaries[j + 1])
                try:
                    span = observation_content_span(ids, after_action, boundary, frame.eot_id, frame.prefix_ids,
                                                    suffixes)
                except ValueError as error:
                    if measure:
                        unmeasured["no_span"] += 1
                        logger.warning("ig_search: sample %d turn %d is not measured (%s)", i, j, error)
                    continue
                contents[i, j] = span
                if span[0] < span[1] and turns.tool_status[i][j] in REACHED_STATUSES:
                    donors.append((i, j))
                if measure and span[0] == span[1]:
                    unmeasured["no_content"] += 1  # an empty result: nothing to compare with a document
                elif measure:
                    context.update(sequence[hashed:boundary].numpy().tobytes())
                    hashed = boundary
                    wanted.append((i, j))
                    keys.append((int(batch.group[i]), context.digest()))
        drawn = draw_documents(keys, [int(batch.group[i]) for i, _ in donors], self.ig_search.seed, batch.step)

        template = cfg.scoring.answer_template(frame.eot_text)
        requests, owners, probes_of, skipped = {}, {}, {}, 0.0
        for (i, j), d in zip(wanted, drawn):
            if d is None:
                unmeasured["no_document"] += 1
                continue
            if i not in probes_of:
                try:
                    probes_of[i] = answer_probes(scorer.tokenizer, (reward_models[i] or {}).get("ground_truth"),
                                                 template, cfg.info_gain.answer_alias)
                except (TypeError, ValueError) as error:
                    probes_of[i] = None
                    skipped += 1
                    logger.warning("ig_search: sample %d is not measured (%s); it gets no information gain", i, error)
            if probes_of[i] is None:
                continue
            (cs, ce), boundary = contents[i, j], int(turns.records[i].boundaries[j + 1])
            di, dj = donors[d]
            ds, de = contents[di, dj]
            copies = [paired_copies(sequences[i], (cs, ce), boundary, sequences[di][ds:de], probe)
                      for probe in probes_of[i]]
            longest = max(len(ids) for pair in copies for ids, _ in pair)
            if scorer.max_positions is not None and cs + longest > scorer.max_positions:
                unmeasured["too_long"] += 1
                continue
            request = requests.setdefault(i, {"boundaries": [], "continuations": []})
            for p, pair in enumerate(copies):
                for side, (ids, span) in enumerate(pair):
                    owners.setdefault(i, []).append((j, p, side))
                    request["boundaries"].append(cs)
                    request["continuations"].append({"token_ids": ids, "span": list(span)})
        rows = list(requests)
        wire = [{"trajectory_ids": sequences[i][:max(requests[i]["boundaries"])], **requests[i]} for i in rows]
        results = scorer.score_counterfactuals(wire) if wire else {}

        aliases = max([len(p) for p in probes_of.values() if p], default=1)
        values = torch.full((2, B, T, aliases), float("nan"), dtype=torch.float64)
        alias_ok = torch.zeros(B, aliases, dtype=torch.bool)
        measured = torch.zeros(B, T, dtype=torch.bool)
        for r, i in enumerate(rows):
            for (j, p, side), value in zip(owners[i], results[r]):
                values[side, i, j + 1, p] = float(value)
                measured[i, j + 1] = True
            alias_ok[i, :len(probes_of[i])] = True
        factual = reduce_alias_logprobs(values[0], alias_ok, cfg.info_gain.answer_alias)
        counterfactual = reduce_alias_logprobs(values[1], alias_ok, cfg.info_gain.answer_alias)
        gain = factual[:, 1:] - counterfactual[:, 1:]
        finite = measured[:, 1:] & torch.isfinite(gain)
        unmeasured["not_finite"] = int((measured[:, 1:] & ~finite).sum())
        if wanted and not bool(finite.any()):
            logger.warning("ig_search: none of the %d turns to measure in step %s could be measured (%s); the step "
                           "trains on the outcome alone", len(wanted), batch.step, unmeasured)
        for reason, count in unmeasured.items():
            metrics[f"ig_search/unmeasured_{reason}"] = float(count)
        metrics["ig_search/measured_turns"] = float(finite.sum())
        metrics["ig_search/scoring_tokens"] = float(sum(
            max(r["boundaries"]) + sum(len(c["token_ids"]) for c in r["continuations"]) for r in wire))
        metrics["timing_s/ig_search_scoring"] = time.perf_counter() - started
        stats = {"ig_requested": float(len(wanted) + unmeasured["no_span"] + unmeasured["no_content"]),
                 "ig_applied": float(finite.sum())}
        return TurnGains(torch.where(finite, gain, 0.0).float(), finite, stats,
                         {"answer_logprob": factual, "random_doc_logprob": counterfactual}, skipped)
