"""The method comparison's arms: each arm's name and the Hydra overrides that make it; everything else is the CPU
demo's configuration (configs/cpu_demo.yaml). ``compare_methods.py --methods`` chooses among these names, so adding
an arm is one entry here."""

METHODS: dict[str, list[str]] = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "igpo": ["algorithm.adv_estimator=igpo"],
    "infopo": ["algorithm.adv_estimator=infopo"],
    "gigpo": ["algorithm.adv_estimator=gigpo"],
    "arpo": ["algorithm.adv_estimator=grpo", "algorithm.arpo.enabled=true"],
    "igpo_arpo": ["algorithm.adv_estimator=igpo", "algorithm.arpo.enabled=true"],
    # IGPO with telescoped chain credit: raw rewards discounted into per-boundary returns with gamma = 1, then
    # z-scored (norm_order=after_discount), so every hop of a chain that reaches the answer shares the chain's gain
    # (docs/methods/igpo.md, the normalisation order).
    "igpo_telescoped": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_order=after_discount",
                        "algorithm.gamma=1.0"],
    # IGPO whose baseline does not depend on how many turns follow (verl RFC #7244's bias): the discounted returns are
    # z-scored once per turn index, nothing normalised is summed afterwards (docs/methods/igpo.md, "Normalising per
    # turn index").
    "igpo_turnnorm": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_order=after_discount",
                      "algorithm.igpo.norm_group=group_turn"],
    # The positive control: the demo world's hops as turn reward in IGPO's pipeline (docs/methods/oracle.md).
    "oracle": ["algorithm.adv_estimator=oracle"],
    # An exploratory variant of the positive control (not in results/turn_credit/plan.md's gate): the hop rewards
    # discounted into returns with the outcome before the z-score, so the outcome stays in every turn's return.
    "oracle_after_discount": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_order=after_discount"],
    # Information gain against a random document in the result's place (docs/methods/ig_search.md).
    "ig_search": ["algorithm.adv_estimator=ig_search"],
    # Potential-based shaping with the frozen reference policy as teacher (docs/methods/tips.md; needs the KL loss on,
    # as configs/igpo_base.yaml has it).
    "tips": ["algorithm.adv_estimator=tips"],
    # Turn credit that can pay for progress (docs/methods/turn_credit.md; results/turn_credit2/plan.md): the turn
    # reward left uncentred, each with verl GRPO's sample sigma (std_ddof=1) so that the outcome channel is GRPO's.
    "oracle_raw_ig": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_mode=raw_ig",
                      "algorithm.igpo.std_ddof=1"],
    "oracle_uncentred": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_mode=uncentred",
                         "algorithm.igpo.ig_weight=0.25", "algorithm.igpo.std_ddof=1"],
    "oracle_potential": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_mode=potential",
                         "algorithm.oracle.progress_unit=chain", "algorithm.igpo.std_ddof=1"],
    "oracle_state": ["algorithm.adv_estimator=oracle", "algorithm.igpo.norm_mode=state_grouped",
                     "algorithm.igpo.std_ddof=1"],
    "igpo_raw_ig": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_mode=raw_ig", "algorithm.igpo.std_ddof=1"],
    "igpo_uncentred": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_mode=uncentred",
                       "algorithm.igpo.turn_std=true", "algorithm.igpo.ig_weight=0.25", "algorithm.igpo.std_ddof=1"],
    "igpo_potential": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_mode=potential",
                       "algorithm.igpo.ig_weight=0.1", "algorithm.igpo.std_ddof=1"],
    "igpo_state": ["algorithm.adv_estimator=igpo", "algorithm.igpo.norm_mode=state_grouped",
                   "algorithm.igpo.ig_weight=0.1", "algorithm.igpo.std_ddof=1"],
}
