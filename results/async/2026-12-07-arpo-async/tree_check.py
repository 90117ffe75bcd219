"""ARPO's tree read back from a run's trajectory log (trainer.trajectory_dir): per step, the branches, their prefix identity
recomputed from the stored ids and masks, and every branch whose own or parent's turns came from more than one weight
version (turn_versions). Usage: python tree_check.py <trajectory_dir>/step_*.jsonl"""
import json, sys
from collections import defaultdict
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path)]
    groups = defaultdict(dict)
    for r in rows:
        rec = r["record"]
        groups[r["uid"]][rec["arpo_index"]] = r
    spanning = [r for r in rows if any(v and v[0] != v[1] for v in r["record"].get("igpo_turn_versions", [])) or
                len({tuple(v) for v in r["record"].get("igpo_turn_versions", []) if v}) > 1]
    nb = across = ok = 0
    for uid, g in groups.items():
        for i, r in g.items():
            rec = r["record"]
            if rec["arpo_parent"] < 0:
                continue
            nb += 1
            p = g[rec["arpo_parent"]]
            n = rec["arpo_branch_pos"]
            same = r["response_ids"][:n] == p["response_ids"][:n] and r["response_mask"][:n] == p["response_mask"][:n]
            ok += same
            ends = p["record"].get("igpo_turn_ends", [])
            shared = [v for v, e in zip(p["record"].get("igpo_turn_versions", []), ends) if v and e < n]
            pv = [v for v in p["record"].get("igpo_turn_versions", []) if v]
            bv = [v for v in rec.get("igpo_turn_versions", []) if v]
            versions = {x for v in pv + bv for x in v}
            if len(versions) > 1:
                across += 1
                print(f"  {path.split('/')[-1]} uid={uid} branch {i} of {rec['arpo_parent']} at {n}: parent turn_versions={pv} branch turn_versions={bv} shared-prefix turn versions={shared} prefix identical={same}")
    print(f"{path.split('/')[-1]}: {len(rows)} trajectories, {len(spanning)} spanning >1 version, {nb} branches, {ok} prefix-identical, {across} with parent/branch turns from >1 version")
