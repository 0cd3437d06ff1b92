"""fully_async: asynchronous RL post-training (GRPO/PPO) for LLMs on Ascend NPU, CUDA and CPU."""
__version__ = "0.2.0"
