"""`python -m sglang.launch_server ...` for tests: the stand-in (`standin_server.py`) with SGLang's flags."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from standin_server import main

if __name__ == "__main__":
    main()
