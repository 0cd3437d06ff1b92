"""Layer 3, training: the shared training step and the backends (torch, FSDP2, megatron)."""
