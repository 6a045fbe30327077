"""`python -m meshllm.testing.conformance NAME|module:Class [-- engine flags]`."""

import sys

from meshllm.testing.conformance.runner import main

sys.exit(main())
