"""Corpora at scale: files and folders of text, JSON lines and Parquet (plain or compressed) read as documents,
a tokenizer learned from an even sample, and a content-keyed token store filled by a tokenizer that can run
beside training. minigpt.data.dataset builds the dataset and batches on top of it; nothing here imports torch.
"""
