"""Conversations: the chat template and its control tokens, conversation data, and the chat session."""
