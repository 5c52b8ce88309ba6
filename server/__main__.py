"""``python -m shardps.server``: same as ``shardps-server``."""

import sys

from shardps.server.cli import main

sys.exit(main())
