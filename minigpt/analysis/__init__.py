"""Looking into a model: what its heads attend to, and its loss on any text."""
