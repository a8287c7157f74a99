"""The stages of a run: rollout, reward, reference, buffer, trainer (each one builder and one
explicit loop), the weights flow between trainer and rollout (`weights`), and the fleet that
starts and supervises a node's workers (`fleet`, `fleet_config`, `supervisor`)."""
