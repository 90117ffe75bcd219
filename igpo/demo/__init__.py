"""The CPU demo's task and policy, used by ``bash train_igpo.sh`` on a machine without a GPU and by the tests:
``world`` (the generated people/companies/cities, their corpus and questions), ``tiny_model`` (a tiny Qwen2 with the
world's names as tokens, copy pre-trained), ``warmstart`` (supervised warm-start into an imperfect searcher) and
``titles`` (the earlier corpus-title questions: the warm-start's task without ``--world-seed``; the parquet schema of
the demo's rows). Nothing here is imported by training on a GPU."""
