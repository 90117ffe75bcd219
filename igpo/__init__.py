"""IGPO for deep-research agents: an extension of verl 0.9.1 (registered through verl's ``verl.plugins`` hook).

Rooms: ``igpo.core`` holds the pure math of each method (IGPO, InfoPO, ARPO); the modules at this level are the thin
verl integration (trainer, estimator, agent loops, actor worker, reward, launch planning, evaluation); ``igpo.cpu``
is the CPU backend; ``igpo.demo`` is the CPU demo's world and tiny model. The commands: ``python -m igpo.main``
(training; ``train_igpo.sh`` runs it), ``python -m igpo.evaluate`` and ``python -m igpo.prepare_data``."""
