"""Layer 3, generation: the pure rollout scheduler, rollout engines and the engine pool."""
