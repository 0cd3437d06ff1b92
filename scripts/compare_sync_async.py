"""The sync-vs-async comparison: `python -m fully_async.compare` (fully_async/compare/), kept under this name for
the commands that used it.  `python scripts/compare_sync_async.py --help` lists the flags."""
import sys

from fully_async.compare.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
