"""Step-1 success of the chain task's warm-started model, sampled as the trainer's rollout samples it (issue 49).

    python scripts/experiments/calibrate_chain.py [--model .cache/tiny_demo_chain_warm] [--seeds 0,1,2,3,4] \
        [--split train]

Every question of the split is played once per seed through the agent loop on the HF rollout server at temperature 1,
each request seeded as in training (``igpo.demo.warmstart.measure_world``): the expected training success of step 1,
before any update. Prints one line per seed and the gate of the comparison's plan: success between 5% and 15% on
every seed and at least 4x a uniform guess among the world's people.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from igpo.demo.warmstart import measure_world
from igpo.demo.world import WorldConfig, build_world, warm_start_config

REPO = Path(__file__).resolve().parents[2]
GATE = (0.05, 0.15)
OVER_CHANCE = 4.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / ".cache" / "tiny_demo_chain_warm"),
                        help="the warm-started chain model (bash train_igpo.sh demo.task=chain builds it)")
    parser.add_argument("--world", default=str(REPO / ".cache" / "demo_world_chain"),
                        help="the chain world's folder (its corpus.jsonl)")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--split", default="train", choices=("train", "val"))
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the rollout")
    parser.add_argument("--json", default=None, help="also write the per-seed reports here")
    args = parser.parse_args()

    world = build_world(WorldConfig(task="chain"))
    config = dataclasses.replace(warm_start_config(task="chain"), threads=args.threads)
    chance = 1 / len(world.employer)
    reports = []
    for seed in (int(s) for s in args.seeds.split(",")):
        start = time.monotonic()
        report = measure_world(args.model, Path(args.world) / "corpus.jsonl", world, split=args.split, seed=seed,
                               config=config)
        report["seed"], report["seconds"] = seed, round(time.monotonic() - start, 1)
        reports.append(report)
        print(json.dumps(report), flush=True)
    successes = [r["exact"] for r in reports]
    low, high = GATE
    met = all(low <= s <= high for s in successes) and min(successes) >= OVER_CHANCE * chance
    print(f"step-1 sampled success per seed: {', '.join(f'{s:.4f}' for s in successes)}; mean "
          f"{statistics.mean(successes):.4f}; chance {chance:.4f} (x{OVER_CHANCE:g} = {OVER_CHANCE * chance:.4f}); "
          f"gate {low:.0%}-{high:.0%} and >= {OVER_CHANCE:g}x chance on every seed: {'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")


if __name__ == "__main__":
    main()
