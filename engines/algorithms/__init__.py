"""RL algorithms as pure tensor functions: advantages, policy losses, KL estimators."""
