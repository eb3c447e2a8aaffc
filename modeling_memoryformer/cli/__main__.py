"""`python -m modeling_memoryformer.cli ...` is `memoryformer ...` (for launchers such as `torchrun -m`)."""

import sys

from . import main

sys.exit(main())
