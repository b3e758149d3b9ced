"""Openings of text of many kinds (code, dialogue, instructions, documentation, lists, prose),
written for this project: prompts from which the heal pass has the source model write its
training text, so that the student learns the source's distributions beyond the calibration
file's domain. Plain strings; a pass encodes them with the model's tokenizer."""
from __future__ import annotations

PROMPTS: tuple[str, ...] = (
    # code
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "import json\nimport os\n\n\ndef load_config(path):\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "#include <stdio.h>\n#include <stdlib.h>\n\nint main(int argc, char **argv) {\n",
    "function debounce(fn, delay) {\n  let timer;\n",
    "SELECT customers.name, COUNT(orders.id) AS n_orders\nFROM customers\n",
    "#!/bin/sh\nset -e\n# Build the project and run its tests\n",
    "fn parse_line(line: &str) -> Option<(String, u32)> {\n",
    "<!DOCTYPE html>\n<html>\n<head>\n  <title>",
    # dialogue
    "User: Can you explain what a hash table is?\nAssistant:",
    "Q: Why is the sky blue?\nA:",
    "\"Did you lock the door?\" she asked.\n\"I think so,\" he said, ",
    "Customer: Hi, my order arrived damaged.\nAgent: I'm sorry to hear that. ",
    "Interviewer: What got you interested in astronomy?\nScientist:",
    # instructions
    "Write a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    "Explain the difference between weather and climate in simple terms.\n\n",
    "Summarize the main causes of the French Revolution.\n\n",
    "Translate the following sentence into French: \"The library opens at nine.\"\n\n",
    "Give three tips for writing clear emails.\n\n1.",
    "Solve step by step: a train travels 120 km in 1.5 hours. What is its average speed?\n\n",
    # documentation
    "## Installation\n\nTo install the package, run\n\n",
    "Parameters\n----------\nx : array_like\n    Input values.\n",
    "README\n\nThis tool converts CSV files into JSON. Usage:\n\n",
    "The `timeout` option sets how long, in seconds, the client waits for ",
    "Returns:\n    A dictionary mapping each user id to ",
    "Chapter 3: Configuring the server\n\nThe configuration file is read at startup. ",
    # lists and structured text
    "Ingredients:\n- 2 cups flour\n- 1 teaspoon salt\n",
    "Shopping list:\n1. milk\n2. ",
    "Pros and cons of working from home:\n\nPros:\n-",
    "Name,Age,City\nAlice,34,Paris\nBob,",
    "Top 5 tallest mountains in the world:\n1. Mount Everest",
    "{\n  \"name\": \"example\",\n  \"version\": \"1.0.0\",\n",
    # prose of other kinds
    "Dear Ms. Patel,\n\nThank you for your letter of March 3. ",
    "Breaking news: heavy rain has flooded parts of the city center, ",
    "The mitochondrion is an organelle found in most eukaryotic cells. It ",
    "Once upon a time, in a village at the edge of a great forest, ",
    "In 1969, the Apollo 11 mission ",
    "Theorem 1. Every bounded monotone sequence of real numbers converges.\nProof.",
    "Meeting notes, Tuesday\nAttendees: Sam, Ines, Kofi\nAgenda:\n",
    "My grandmother's garden was full of ",
)

__all__ = ["PROMPTS"]
