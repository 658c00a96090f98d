"""`python -m ptq` runs the same CLI as `ptq`."""

import sys

from ptq.cli import main

sys.exit(main())
