"""The text front door: tokenizers, chat templates, the OpenAI-compatible HTTP server
(`kvpool serve`), KV-aware routing across workers found through the managers.

The offline LLM is ``kvpool.llm``; the demo, its load generator and local clusters are
``kvpool.devcluster``."""
