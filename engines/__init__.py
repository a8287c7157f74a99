"""Engines: rollout (generation) and train backends behind small Protocols,
and the RL algorithms."""
