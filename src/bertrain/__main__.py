"""`python -m bertrain …` (and so `torchrun -m bertrain pretrain …`): the same entry as the `bertrain` script."""
from bertrain.cli import entry

entry()
