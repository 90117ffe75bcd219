"""The agent side of a rollout: the agent loops (plain and branching), the tool-call protocol, the agent config."""
