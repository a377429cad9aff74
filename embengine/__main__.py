"""``python -m embengine``: the ``embengine`` command."""

import sys

from .cli import main

sys.exit(main())
