"""`python -m fully_async.plan [plan.key=value ...] [overrides]`: memory, device plan and async-vs-sync throughput
of a config before any device is used (fully_async/run/plan_cli.py)."""
import sys

from fully_async.run.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
