"""The text front door: tokenizers, chat templates, the OpenAI-compatible HTTP server
(`kvpool serve`), KV-aware routing across workers found through the managers, the offline LLM."""
