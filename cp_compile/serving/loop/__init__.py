"""The one step loop and its scheduler (the serving layer under `hf`, `spec_decode`
and the entry points, so each of them can run through it): `scheduler.py`
(continuous batching on the host: `Scheduler`, `StepPlan`, `Sequence`) and
`step_loop.py` (`StepLoop`: plan -> proposer phase -> execute -> choose -> commit)."""
