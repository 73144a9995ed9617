"""The compile front door: `backend` (the cp_ascend torch.compile backend), `decorator`
(@cp_module, compile_model, CompiledForward), `lowering` (Inductor | aot_eager | eager |
torchair) and `step_check` (the backend's per-call check of what it compiled for)."""
