"""`python -m meshllm`: the same as the `meshllm` console script."""

import sys

from meshllm.cli import main

sys.exit(main())
