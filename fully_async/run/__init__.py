"""Entry points (layer 7): `python -m fully_async.main` / `.doctor` / `.plan`, the launcher (start Ray, create actors,
supervise, signals, checkpoints, resume), the checks before Ray (prepare), Hydra wiring and the driver's logging.
It may import every layer below; only the package's root entry shims import it."""
