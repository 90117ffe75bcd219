"""Launch planning (what a run needs, checked before it starts) and the published recipes."""
