"""Run by the installers with the target environment's Python before they install anything: exit 2 with one line
when rLLM itself (the distribution `rllm`) is installed there, since this package would overwrite its files (both
install the top-level package `rllm`) and rLLM's training extra pins another verl.

The rule lives in rllm/experimental/fully_async/__init__.py (its import refuses); this script imports that module
from the source tree, which needs nothing installed.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the source tree's `rllm`, ahead of any installed one
try:
    import rllm.experimental.fully_async  # noqa: F401 (the import is the check)
except ImportError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
