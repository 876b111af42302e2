import sys
from pathlib import Path

# tests import the launcher helpers by module name; the package itself comes from the install
# (`pip install -e python`) or, failing that, from the source tree.
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import motley_torch  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent))
