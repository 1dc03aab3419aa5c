"""One trainer rank of the elastic example, attached to the daemon (torchrun-compatible).

    # a store host that outlives the trainers (or let torchrun's agent host it)
    python -m dynaresized.backends.torch.store --port 29600 &
    python examples/torch_elastic/train.py --daemon tcp://127.0.0.1:5555 --store 127.0.0.1:29600 \\
        --devices node0:cpu0,node0:cpu1,node0:cpu2,node0:cpu3 --initial 2 --device node0:cpu2

    torchrun --standalone --nproc-per-node 4 examples/torch_elastic/train.py \\
        --daemon tcp://127.0.0.1:5555 --devices node0:cpu0,node0:cpu1,node0:cpu2,node0:cpu3 --initial 2

The model defaults to a ~34M-parameter MLP on synthetic data (`--job-options` to change it).
Every process is kept for the whole job; the daemon's ops (see docs/torch-backend.md) grow and
shrink the data-parallel group at optimizer-step boundaries.
"""

from __future__ import annotations

import sys

from dynaresized.backends.torch.worker import main

DEFAULTS = ["--job-options", '{"width": 4096, "depth": 3}', "--offload"]

if __name__ == "__main__":
    argv = sys.argv[1:]
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra = [] if "--job-options" in given else DEFAULTS[:2]
    extra += [] if "--no-offload" in given else DEFAULTS[2:]
    argv = [a for a in argv if a != "--no-offload"]
    sys.exit(main(extra + argv))
