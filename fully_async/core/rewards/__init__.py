"""Rewards (layer 0): rule-based scores by data_source, custom functions, and reward managers."""
from fully_async.core.rewards.manager import RewardManager, build_reward_manager
from fully_async.core.rewards.scoring import RewardError, default_compute_score, load_custom_score

__all__ = ["build_reward_manager", "RewardManager", "default_compute_score", "load_custom_score", "RewardError"]
