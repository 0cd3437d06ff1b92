"""Ray plumbing (layer 2): starting or joining Ray, waiting for actors, root causes of actor failures, group
addresses.  It imports core and the domain packages below it (telemetry); placement (placement groups, the
device pool and its clients), weight_sync and every layer above import it."""
