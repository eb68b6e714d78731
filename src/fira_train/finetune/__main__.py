"""``python -m fira_train.finetune`` == ``fira-train finetune``."""

import sys

from fira_train.finetune.cli import main

if __name__ == "__main__":
    sys.exit(main())
