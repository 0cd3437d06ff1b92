"""`python -m fully_async.doctor [overrides]`: the environment check (fully_async/run/doctor.py)."""
import sys

from fully_async.run.doctor import main

if __name__ == "__main__":
    sys.exit(main())
