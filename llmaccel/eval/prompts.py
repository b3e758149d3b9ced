"""Openings of text of many kinds (code, dialogue, instructions, documentation, lists, prose),
written for this project: prompts from which the heal pass has the source model write its
training text, so that the student learns the source's distributions beyond the calibration
file's domain. GROUNDED and OPEN: whole prompts for measuring speculative decoding (`llmc bench
--prompts`). Plain strings; the user encodes them with the model's tokenizer."""
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

# Prompts for measuring speculative decoding (`llmc bench --prompts`). GROUNDED: the answer
# repeats text the prompt carries (a passage, code, a list, JSON, a table of 150-400
# characters), where a draft that copies from the prompt (ngram) can be right; OPEN: answers
# that copy nothing, where it can only be wrong. The pair bounds what a draft gains.
_GROUNDED_PARTS: tuple[tuple[str, str], ...] = (
    # prose
    ("Repeat this passage exactly, word for word:",
     "The lighthouse stood on a ledge of black rock at the end of the harbour wall. Every evening "
     "the keeper climbed its ninety-one steps, trimmed the wick, polished the lens and wrote the "
     "weather in a ledger. In forty years he missed only one night, when the snow was too deep "
     "to reach the door."),
    ("Repeat this passage, changing every \"cat\" to \"dog\":",
     "Our cat wakes up before anyone else. The cat sits by the kitchen door and waits until "
     "someone fills the bowl. After breakfast the cat walks along the fence, checks every corner "
     "of the garden and then sleeps in the sun until the children come home from school."),
    ("Correct the spelling mistakes in this paragraph and repeat it:",
     "The comittee met on Thursday to discus the new budjet. Most members agred that the park "
     "needed more benches and better lighting, but nobody could decide how to pay for them. The "
     "chair sugested a small fee for the summer concerts, and the vote was postponed untill May."),
    ("Answer using the passage. When does the library close on Saturdays?",
     "The Riverside Library opens at nine every weekday and closes at eight in the evening, "
     "except on Fridays, when it closes at six. On Saturdays it opens at ten and closes at four. "
     "It is closed on Sundays and public holidays. Books can be returned at any time through the "
     "slot beside the main entrance."),
    ("Answer using the passage, quoting the sentence that says so. What should a hiker carry?",
     "The north trail climbs four hundred metres over six kilometres and takes most walkers three "
     "hours. There is no water on the route, so each hiker should carry at least two litres. The "
     "path is rocky after the second bridge. Rangers close the trail when strong winds are "
     "forecast, and the gate is locked at sunset."),
    ("Answer using the passage. How long must the dough rest, and where?",
     "Mix the flour, salt and yeast in a large bowl, then add the warm water and stir until no "
     "dry flour remains. Cover the bowl with a damp cloth and let the dough rest in a warm place "
     "for two hours, until it has doubled in size. Shape it into a round loaf and bake it at two "
     "hundred and twenty degrees for forty minutes."),
    ("Rewrite this passage in the past tense, keeping everything else the same:",
     "Mara opens the shop at seven. She sweeps the floor, sets out the fresh fruit and writes the "
     "day's prices on the chalkboard by the door. The first customers are usually the bakers from "
     "across the street, who buy lemons and eggs. By noon the shelves are half empty and she "
     "starts to plan the next order."),
    # Python code
    ("Fix the typo in this code:",
     "def average(values):\n    \"\"\"Return the mean of a non-empty list of numbers.\"\"\"\n"
     "    total = 0\n    for v in values:\n        total += v\n    retrun total / len(values)\n\n\n"
     "print(average([3, 5, 10]))\n"),
    ("Fix the typo in this code:",
     "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
     "    def add(slef, word):\n        self.counts[word] = self.counts.get(word, 0) + 1\n\n"
     "    def most_common(self):\n        return max(self.counts, key=self.counts.get)\n"),
    ("Rename the variable `x` to `count` in this code and repeat the whole function:",
     "def count_vowels(text):\n    x = 0\n    for ch in text.lower():\n"
     "        if ch in \"aeiou\":\n            x += 1\n    return x\n\n\n"
     "def has_more_vowels(a, b):\n    return count_vowels(a) > count_vowels(b)\n"),
    ("Add type hints to this function and repeat it:",
     "def merge_counts(a, b):\n    \"\"\"Sum two word-count dictionaries into a new one.\"\"\"\n"
     "    out = dict(a)\n    for key, value in b.items():\n"
     "        out[key] = out.get(key, 0) + value\n    return out\n"),
    ("Fix the typo in this code:",
     "import json\n\n\ndef load_settings(path):\n    with open(path) as f:\n"
     "        data = json.laod(f)\n    data.setdefault(\"theme\", \"light\")\n"
     "    data.setdefault(\"font_size\", 12)\n    return data\n"),
    # lists
    ("Continue this numbered list with three more steps in the same style:",
     "How to pitch a tent:\n1. Choose flat ground without stones or roots.\n"
     "2. Lay the groundsheet down with the shiny side up.\n"
     "3. Spread the tent over the groundsheet and line up the corners.\n"
     "4. Push a peg through each corner loop at an angle away from the tent.\n"),
    ("Continue this numbered list up to item 8, in the same style:",
     "Weekly chores:\n1. Monday: water the plants on the balcony.\n"
     "2. Tuesday: take the recycling out to the street.\n"
     "3. Wednesday: change the bed sheets.\n4. Thursday: clean the bathroom sink and mirror.\n"
     "5. Friday: plan the meals for the weekend.\n"),
    ("Continue this numbered list of meeting notes, repeating the format:",
     "Project meeting, 14 March\n1. Action: Ines updates the test plan by Friday.\n"
     "2. Action: Kofi asks the printer for a new quote.\n"
     "3. Decision: the launch moves to the first week of May.\n"
     "4. Action: Sam books the room for the next review.\n"),
    ("Convert this list into a JSON array of objects with the keys \"title\" and \"year\":",
     "Books on the shelf:\n- The Glass Orchard (1998)\n- A Winter of Small Boats (2004)\n"
     "- Letters from the Salt Road (2011)\n- The Clockmaker's Garden (2016)\n"
     "- Notes on a Quiet River (2020)\n"),
    # JSON
    ("Change the port to 8081 and repeat the whole JSON:",
     "{\n  \"server\": {\n    \"host\": \"0.0.0.0\",\n    \"port\": 8080,\n"
     "    \"workers\": 4\n  },\n  \"database\": {\n    \"url\": \"postgres://localhost/shop\",\n"
     "    \"pool_size\": 10\n  },\n  \"logging\": {\n    \"level\": \"info\",\n"
     "    \"file\": \"server.log\"\n  }\n}\n"),
    ("Add the field \"active\": true to each record and repeat the JSON:",
     "[\n  {\"id\": 1, \"name\": \"Alice\", \"email\": \"alice@example.com\"},\n"
     "  {\"id\": 2, \"name\": \"Bruno\", \"email\": \"bruno@example.com\"},\n"
     "  {\"id\": 3, \"name\": \"Chen\", \"email\": \"chen@example.com\"},\n"
     "  {\"id\": 4, \"name\": \"Dara\", \"email\": \"dara@example.com\"}\n]\n"),
    # tables
    ("Add a column \"Total\" (the sum of the three months) to this table:",
     "| Product | January | February | March |\n|---|---|---|---|\n"
     "| Apples | 120 | 135 | 150 |\n| Pears | 80 | 75 | 90 |\n| Plums | 45 | 60 | 70 |\n"
     "| Cherries | 30 | 25 | 55 |\n"),
    ("Sort the rows of this table by population, largest first:",
     "City,Country,Population\nLisbon,Portugal,545000\nVienna,Austria,1920000\n"
     "Oslo,Norway,700000\nPrague,Czechia,1300000\nDublin,Ireland,590000\n"
     "Helsinki,Finland,660000\nAthens,Greece,640000\n"),
    ("Convert this table to CSV:",
     "| Name | Role | Start date |\n|---|---|---|\n| Priya | Engineer | 2021-03-01 |\n"
     "| Tomas | Designer | 2019-11-15 |\n| Lena | Manager | 2018-06-04 |\n"
     "| Omar | Analyst | 2022-01-10 |\n"),
    ("Answer using the table. Which team scored the most points, and how many?",
     "| Team | Played | Won | Lost | Points |\n|---|---|---|---|---|\n"
     "| Harbour FC | 10 | 7 | 3 | 21 |\n| Hill Rovers | 10 | 6 | 4 | 18 |\n"
     "| Valley United | 10 | 8 | 2 | 24 |\n| River City | 10 | 3 | 7 | 9 |\n"),
)
GROUNDED: tuple[str, ...] = tuple(f"{task}\n\n{text}\n" for task, text in _GROUNDED_PARTS)

OPEN: tuple[str, ...] = (
    "Write a short story about a girl who finds a key that opens every door except her own.",
    "Tell a story about a robot who wants to learn to paint.",
    "Write a short fable about a fox, a crow and a river that floods.",
    "Tell me a bedtime story about a small dragon who is afraid of the dark.",
    "Write the opening of a mystery set on a night train across the mountains.",
    "Write a poem about the first day of autumn.",
    "Explain how vaccines train the immune system, in simple words.",
    "Explain why the sea is salty.",
    "Explain what inflation is and why prices rise over time.",
    "Explain how a computer stores numbers in binary.",
    "Why do cats purr? Explain what scientists think.",
    "Explain the difference between a virus and a bacterium.",
    "How does a bicycle stay upright when it moves?",
    "What happens in the brain when we sleep?",
    "Give me advice on how to prepare for a job interview.",
    "How can I keep a small vegetable garden healthy through a dry summer?",
    "What are some good ways to learn a new language as an adult?",
    "Give me tips for running my first ten-kilometre race.",
    "How should I plan a week of cheap, healthy dinners?",
    "My friend and I had an argument. How can I make things right?",
    "Suggest ideas for a rainy afternoon with two young children.",
    "Describe a perfect day in a city you would like to visit.",
    "What would change if people could no longer lie?",
    "Write a letter to your future self, ten years from now.",
)

__all__ = ["GROUNDED", "OPEN", "PROMPTS"]
