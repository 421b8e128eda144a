import sys

from hicache.cli import main

sys.exit(main())
