"""``python -m fira_train`` == ``fira-train`` (also under ``torchrun -m fira_train``)."""

import sys

from fira_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
