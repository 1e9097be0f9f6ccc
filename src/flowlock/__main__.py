"""``python -m flowlock``: the same command line as the ``flowlock`` script."""

import sys

from flowlock.cli import main

sys.exit(main())
