"""Tokenizers behind one interface: characters, trained byte-level BPE, tiktoken encodings, Hugging Face files."""
