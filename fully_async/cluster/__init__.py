"""Ray plumbing (layer 2): placement groups, waiting for actors, root causes of actor failures, group addresses, the
device-pool service and its clients (lease client of a job's worker, membership and heartbeat of its driver).  It
imports core and the domain packages below it (pool, telemetry); weight_sync and every layer above import it."""
