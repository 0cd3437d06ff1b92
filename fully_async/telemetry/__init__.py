"""What a run reports (layer 1; no Ray): verl-named metric computation and its sinks (metrics: console line,
TensorBoard), experiment trackers (tracking: W&B, SwanLab, MLflow) and Perfetto timelines of spans (timeline).  It
imports only core; the actors, the training step, the pool service and the run's logging import it."""
