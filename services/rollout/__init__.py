"""The rollout driver: agentic trajectories (LLM turns, actions in sandboxes, rewards) with
checkpoints decided by the policy service and recovery from sandbox failures."""
