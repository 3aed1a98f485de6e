"""Training: the loop, a run's setup, a step, checkpoints, the budget, optimizers, fine-tuning, several processes."""
