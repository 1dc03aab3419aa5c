"""`python -m dynaresized.integrations.verl --hybrid H --standalone S` prints the daemon's
[cluster] section for a verl job."""

import sys

from dynaresized.integrations.verl.layout import main

sys.exit(main())
