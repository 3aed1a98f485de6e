"""Generation: the decode loop written once, its settings, and the engines that run it."""
