"""Training text as token ids: the data settings, preparing a corpus, splits and batches."""
