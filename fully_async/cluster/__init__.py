"""Layer 1, Ray plumbing: placement groups, waiting for actors, root causes of actor failures, group addresses."""
