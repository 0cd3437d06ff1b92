"""Generation (layer 5): the pure rollout scheduler (admission under the staleness bound, partial responses,
interrupt/resume, groups), the rollout engines (embedded hf, vLLM, a class by path) and the engine pool over K
replicas.  It imports the layers below (core, the domain packages, cluster, weight_sync) and never train/; the
actors and the run import it."""
