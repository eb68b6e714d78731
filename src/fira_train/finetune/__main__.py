"""``python -m fira_train.finetune`` == ``fira-train finetune``: the same entry point, so errors are
one line and Ctrl-C says what is kept, as there."""

import sys

from fira_train.cli import main

if __name__ == "__main__":
    sys.exit(main(["finetune", *sys.argv[1:]]))
