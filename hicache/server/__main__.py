"""`python -m hicache.server ...`: the same as `hicache serve ...`."""

import sys

from hicache.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
