"""Serving, the top library layer: `hf` (unmodified HF models: Engine, Scheduler),
`spec_decode` (speculative decoding), `kv_transfer` (PD disaggregation over NIXL) and
`entrypoints` (the offline LLM, the OpenAI-compatible server, the driver over them)."""
