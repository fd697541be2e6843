"""``python tests/rollback_script.py train ...`` (also under ``accelerate launch``): linnaeus-accel's
command line with the dataset and callback of ``helpers.rollback`` registered, as a user's training
script would register its own (tests/test_rollback.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a script's folder; also under runpy

import helpers.rollback  # noqa: F401  (registers poisoned_digits and blow_up)

from linnaeus_accel.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
