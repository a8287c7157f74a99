"""Engines: rollout (generation) and train backends behind small Protocols (`engines.protocols`),
built from the config's engine section by `engines.build`, and the RL algorithms."""
