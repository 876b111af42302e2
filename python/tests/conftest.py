import sys
from pathlib import Path

# tests import the launcher helpers by module name, and the package from this source tree,
# whatever checkout a reused venv's editable install points at (the ranks the tests start get
# the same tree on PYTHONPATH: launcher.python_env).
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
