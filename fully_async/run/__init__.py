"""Layer 5, entry points: `python -m fully_async.main` / `fully_async.doctor`, the launcher, preparation, logging."""
