"""The workers of a run: rollout, reward, buffer, trainer — each one explicit async loop — and the fleet."""
