"""`python -m dynaresized.sim simulate|bench ...`: the simulator's subcommands on their own."""

import sys

from dynaresized.sim.cli import main

sys.exit(main())
