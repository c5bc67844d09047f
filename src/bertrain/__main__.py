"""`python -m bertrain …` (and so `torchrun -m bertrain pretrain …`)."""
import logging
import os
import sys

from bertrain.cli import main

code = main()
if "torch.distributed" in sys.modules:
    import torch.distributed as torch_dist

    if torch_dist.is_available() and getattr(torch_dist, "_bertrain_joined", False):
        # A process that joined a process group ends here without the interpreter's teardown: gloo's and the
        # store's C++ threads are destroyed there in no fixed order, which intermittently aborts an otherwise
        # finished run ("terminate called without an active exception", exit -6). Every output is already written
        # and closed (atomic writes, the group destroyed by distributed_context); only the streams need flushing.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
sys.exit(code)
