"""The rollout worker and its built-in torch engine."""
