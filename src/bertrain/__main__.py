"""`python -m bertrain …` (and so `torchrun -m bertrain pretrain …`)."""
import sys

from bertrain.cli import main

sys.exit(main())
