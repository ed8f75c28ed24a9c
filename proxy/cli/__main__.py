"""`python -m proxy.cli ...` is `rlproxy ...`."""

import sys

from proxy.cli.main import main

sys.exit(main())
