"""python -m llmaccel.bench SRC ...: `llmc bench` without the console script."""
import sys

from llmaccel.bench.cli import main

sys.exit(main())
