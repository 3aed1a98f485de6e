"""Run folders: the one owner of their files, their model cards, and summaries of the runs there are."""
