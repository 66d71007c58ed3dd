"""The ``openai_agent`` generator's OpenAI-compatible endpoint: the HTTP server and one sample's session."""
