"""The kinds of JSONL records a run trains on, by name: what minigpt.feedback.records reads a file as, and
what the train settings choose their rates by (kept here, free of imports, so that reading the settings
loads none of the readers)."""

CONVERSATIONS, PREFERENCES, TASKS = "conversations", "preference pairs", "tasks"
