"""The agent side of a rollout: the agent loops (plain and branching), the tool-call protocol, the agent config."""

# The dataset's extra_info key for a chain question's entities, in the order a correct chain searches them: written by
# the demo world (igpo/demo/world.py), read by records.hop_targets. Kept here so that writing a dataset imports no torch.
HOP_TARGETS_KEY = "hop_targets"
