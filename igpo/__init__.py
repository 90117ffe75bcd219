"""IGPO for deep-research agents: an extension of verl 0.9.1 (registered through verl's ``verl.plugins`` hook)."""
