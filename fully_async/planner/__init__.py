"""The planner (layer 1; no Ray, no torch at import): device specs and model shapes (hardware), per-device memory of
each role (memory_model), a discrete-event simulation of sync, split and elastic async (pipeline_sim) and colocated
async (colocated_sim) on shared engine-replica and cost records (sim_engine), all driving the real staleness bound
and the trainer's push rule, stage costs measured from runs (stage_costs) and the search for the best mode and
rollout / trainer split per device count (search).  It imports only core; `python -m fully_async.plan` (run/) and
the scripts import it."""
