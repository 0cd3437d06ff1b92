"""Thin Ray actors (layer 6) over the layers below: the queue, the rollouter, the trainer, the sync worker, the
trainer rank shell, engine replicas, the pool actor, and their residency (where a side's weights live between
pieces of work: its own devices, a pool lease, or an engine and a trainer taking turns).  They hold no algorithm:
they call the layers below and move data between processes.  Only run/ imports them."""
