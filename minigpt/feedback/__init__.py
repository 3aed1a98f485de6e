"""Learning from feedback: preference tuning (DPO) and reinforcement learning with verifiable rewards (GRPO)."""
