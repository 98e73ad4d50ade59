"""``python -m szo ...`` = the ``szo`` console script."""
import sys

from szo.cli import main

sys.exit(main())
