"""Python imports this module at start where this folder is on its path (PYTHONPATH): the
stand-ins of tests/sglang_standins.py for the whole process, so that SGLang imports on this CPU
machine. tests/test_sglang_docs.py runs the docs' commands so."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import sglang_standins

sglang_standins.install()
