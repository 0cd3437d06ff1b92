"""`python -m fully_async.main key=value ...`: the training entry point (fully_async/run/main.py)."""
from fully_async.run.main import main

if __name__ == "__main__":
    main()
