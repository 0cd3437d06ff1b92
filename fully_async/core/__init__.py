"""Layer 0, pure: config schema, types, staleness, data, batches, algorithms, rewards, metrics, checkpoint
files, timeline, workload.  Imports nothing from the other layers and never imports Ray."""
