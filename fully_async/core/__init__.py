"""The shared base (layer 0; no Ray): the typed config schema and its checks (config, config_checks, plan;
rollout_correction_spec parses verl's rollout-correction threshold strings), the records that cross module
boundaries (types, batch, partial), the staleness bound and the trainer's state and rules (staleness,
trainer_state), prompt data (data), benchmark workloads (workload), checkpoint files (checkpoint), model FLOPs
(flops) and pinned host buffers for offload (host_offload: the one torch memory primitive both engines and trainers
use).  It imports nothing else of the package; every other package may import it."""
