"""Front ends: the offline `LLM` (llm.py), the OpenAI-compatible server (server.py,
`cp-compile serve`), and what both share: the driver (scheduler + sampler,
driver.py) and where the ranks run (executors.py, worker.py)."""
