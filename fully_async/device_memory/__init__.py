"""Device memory that a turn switch really gives back and takes again cheaply (layer 0): arenas at fixed addresses
over CUDA's virtual memory management, or a host stand-in for CI and the NPU stand-in (arena.py, cuda_vmm.py), and
what `free_cache_engine` means at each switch, keep what fits or free (policy.py, pure).  It imports only torch and
the standard library; the engines (rollout/engines/engine_memory.py, hf_engine.py) and the run's config checks import
it."""
