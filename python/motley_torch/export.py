"""`python -m motley_torch.export`: a checkpoint step to a Hugging Face directory
(`motley_torch.components.export`; this module is only its command-line entry point)."""

import sys

from .components.export import main

if __name__ == "__main__":
    sys.exit(main())
