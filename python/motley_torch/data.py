"""`python -m motley_torch.data`: `prepare` text files into a Megatron indexed dataset,
`inspect` one (`motley_torch.components.data`; this module is only its command-line entry
point)."""

import sys

from .components.data import main

if __name__ == "__main__":
    sys.exit(main())
