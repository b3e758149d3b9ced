"""python -m llmaccel.bench SRC ...: `llmc bench` without the console script, with llmc's error
handling."""
import sys

from llmaccel.cli import main

args = sys.argv[1:]
sys.exit(main(args if args[:1] == ["bench"] else ["bench", *args]))
