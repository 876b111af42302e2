"""`python -m motley_torch.profile`: the layer profiler (Motley's profiles file, `motley plan
--profiles`) (`motley_torch.tools.profile`; this module is only its command-line entry point)."""

import sys

from .tools.profile import main

if __name__ == "__main__":
    sys.exit(main())
