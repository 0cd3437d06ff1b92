"""The planner (layer 1; no Ray, no torch at import): device specs and model shapes (hardware), per-device memory of
each role (memory_model), a discrete-event simulation of the sync and async pipelines that drives the real
staleness bound (pipeline_sim), stage costs measured from runs (stage_costs) and the search for the best rollout /
trainer split (search).  It imports only core; `python -m fully_async.plan` (run/) and the scripts import it."""
