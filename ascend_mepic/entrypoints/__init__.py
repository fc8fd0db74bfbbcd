"""How users reach MEPIC: the OpenAI-compatible server, the offline ``LLM`` API and the CLI."""
