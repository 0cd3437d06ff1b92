"""Layer 4, thin Ray actors over layers 0-3: queue, rollouter, trainer, sync worker, trainer group, engine replicas."""
