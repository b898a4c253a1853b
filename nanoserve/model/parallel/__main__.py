"""A tensor-parallel worker process: `python -m nanoserve.model.parallel` (launch.py)."""

from nanoserve.model.parallel.worker import main

if __name__ == "__main__":
    main()
