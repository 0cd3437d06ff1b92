"""Rewards (layer 1; no Ray): rule-based scores by data_source (gsm8k, math, DAPO, prime, geo3k, search-r1, ...),
custom reward functions run in an isolated worker process with a timeout, and the reward managers that score a
group.  It imports only core; the rollout side, the actors and the run's preparation import it."""
from fully_async.rewards.manager import RewardManager, build_reward_manager
from fully_async.rewards.scoring import RewardError, default_compute_score, load_custom_score

__all__ = ["build_reward_manager", "RewardManager", "default_compute_score", "load_custom_score", "RewardError"]
