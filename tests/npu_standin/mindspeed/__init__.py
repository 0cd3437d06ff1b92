"""A stand-in for Ascend's MindSpeed (test-only, beside the torch_npu stand-in): on the stand-in's CPU/CUDA backend
megatron-core runs unpatched, so the adaptor patches nothing; it checks what MindSpeed needs of its caller, that
it is imported before megatron is."""
