"""Training (layer 5): the one training step both modes run (train_step), the one PPO update over epochs x mini-
batches x micro-batches (ppo_update) and its batch cuts (sharding), the data-parallel group (group), and the backends
(torch, FSDP2, megatron) that expose only forward/backward of a micro-batch, the optimizer step, weights,
checkpoints and offload.  It imports the layers below and never rollout/; the actors and the run import it."""
