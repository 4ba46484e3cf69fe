"""Write synthetic training prompts for the shipped drafters (docs/DRAFTERS.md).

A drafter learns what the *target* says, so its training data is the target's
answers to prompts; the prompts only have to look like the traffic it will
serve. 259 dev questions are too few (a drafter overfits them in minutes), so
this script makes a few thousand more, offline and deterministically:

- math: word problems from templates (GSM8K-like), arithmetic and reasoning
  puzzles, coding and STEM questions;
- extraction: summaries of passages from the *training* split's articles
  and RAG contexts (cut, recombined, asked for in other words), questions
  about those passages, and trivia questions from templates;
- language: German sentences from the training split's translation prompts
  (whole, split at clauses, joined in pairs), writing, role-play and
  humanities requests from templates.

Nothing from the bench's held-out questions (router.domains.split_dev) is used.

    python scripts/make_synthetic_prompts.py ../shared/data/spec_bench/dev.jsonl data/drafter-corpora
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.domains import read_questions, split_dev  # noqa: E402

NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Isabel", "Jamal", "Kim", "Liam",
         "Maya", "Noah", "Olivia", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki", "Zoe"]
ITEMS = [("apples", 1), ("books", 12), ("pencils", 1), ("cupcakes", 3), ("tickets", 15), ("shirts", 20),
         ("plants", 8), ("toy cars", 5), ("notebooks", 4), ("bottles of juice", 2), ("bags of rice", 9),
         ("packs of stickers", 3), ("candles", 6), ("video games", 40), ("bracelets", 7)]
PLACES = ["the farmers market", "a bakery", "the school fair", "an online store", "the bookstore", "the zoo shop"]

MATH_TEMPLATES = [
    lambda r, n, i, p, a, b, c: f"{n} buys {a} {i[0]} at {p} for ${i[1]} each and {b} more the next day. "
                                f"How much does {n} spend in total?",
    lambda r, n, i, p, a, b, c: f"{n} has {a * c} {i[0]}. {n} gives {a} to a friend and sells half of the rest. "
                                f"How many {i[0]} does {n} have left?",
    lambda r, n, i, p, a, b, c: f"A class of {a + b} students collects {i[0]}. Each student brings {c}. "
                                f"If {b} students forget, how many {i[0]} does the class collect?",
    lambda r, n, i, p, a, b, c: f"{n} earns ${a * 5} a week and saves {10 * (c % 9 + 1)}% of it. "
                                f"How much does {n} save in {b} weeks?",
    lambda r, n, i, p, a, b, c: f"A train travels {a * 10} miles in {c} hours. At the same speed, how far does it "
                                f"travel in {b} hours?",
    lambda r, n, i, p, a, b, c: f"{n} is {a} years old. {n}'s mother is {c} times as old. How old will the mother "
                                f"be in {b} years?",
    lambda r, n, i, p, a, b, c: f"A rectangle is {a} meters long and {b} meters wide. What is its area and its "
                                f"perimeter?",
    lambda r, n, i, p, a, b, c: f"{n} reads {a} pages a day. The book has {a * b + c} pages. How many days does "
                                f"it take to finish the book?",
    lambda r, n, i, p, a, b, c: f"At {p}, {i[0]} cost ${i[1]} each, or ${i[1] * 5 - c % 4} for a pack of five. "
                                f"{n} needs {a * 5} {i[0]}. How much does {n} save by buying packs?",
    lambda r, n, i, p, a, b, c: f"{n} and {r.choice(NAMES)} share {a * 6} {i[0]} in the ratio 1:{c}. How many "
                                f"does each get?",
    lambda r, n, i, p, a, b, c: f"A tank holds {a * 20} liters. It is filled at {b} liters per minute and drains at "
                                f"{c} liters per minute. How long does it take to fill?",
    lambda r, n, i, p, a, b, c: f"{n} runs {a} km on Monday, twice as far on Tuesday and {b} km less than that on "
                                f"Wednesday. How far does {n} run over the three days?",
    lambda r, n, i, p, a, b, c: f"The price of {i[0]} went up by {c * 5}% from ${a * 4}. What is the new price?",
    lambda r, n, i, p, a, b, c: f"Solve for x: {a}x + {b} = {a * c + b}.",
    lambda r, n, i, p, a, b, c: f"What is {a * 13} divided by {c}, rounded to two decimal places? Explain.",
    lambda r, n, i, p, a, b, c: f"A bag has {a} red, {b} blue and {c} green marbles. What is the probability of "
                                f"drawing a blue marble?",
]
PUZZLES = [
    "If all {a} are {b} and some {b} are {c}, are some {a} necessarily {c}? Explain.",
    "{n} is taller than {m}, and {m} is taller than {o}. Who is the shortest? Explain your reasoning.",
    "A farmer has {x} chickens and cows with {y} legs in total. How many cows are there?",
    "What comes next in the sequence {s}? Explain the pattern.",
    "If today is {d}, what day of the week will it be in {x} days?",
]
CODING = ["reverse a linked list", "check whether a string is a palindrome", "find the second largest number in a list",
          "count the words in a text file", "merge two sorted lists", "compute the nth Fibonacci number",
          "remove duplicates from a list while keeping order", "validate an email address", "parse a CSV file into "
          "dictionaries", "find all prime numbers below n", "implement binary search", "flatten a nested list",
          "convert Celsius to Fahrenheit", "compute the factorial of a number recursively", "sort a list of tuples by "
          "the second element", "find the longest common prefix of a list of strings", "implement a stack class",
          "read JSON from a file and print its keys", "check whether two strings are anagrams",
          "compute the average of the numbers in a list", "implement a queue using two stacks",
          "find the most frequent element in a list", "rotate a matrix by 90 degrees", "compute the GCD of two numbers"]
LANGS = ["Python", "JavaScript", "C++", "Java", "Go", "Rust"]
STEM = ["photosynthesis", "the water cycle", "Newton's second law", "how vaccines work", "the greenhouse effect",
        "DNA replication", "how a transistor works", "plate tectonics", "the speed of light", "black holes",
        "entropy", "how batteries store energy", "the immune system", "the structure of an atom", "evolution by "
        "natural selection", "how the internet routes packets", "machine learning", "climate change", "osmosis",
        "the Pythagorean theorem", "supply and demand", "compound interest", "how airplanes fly", "nuclear fission",
        "the periodic table", "how the heart pumps blood", "renewable energy", "ocean tides", "earthquakes",
        "the solar system", "antibiotic resistance", "quantum computing", "how GPS works", "sound waves"]
STEM_FORMS = ["Explain {t} in simple terms.", "What is {t}? Give an example.", "Describe {t} to a high school student.",
              "What are the main ideas behind {t}?", "Why is {t} important?", "Explain {t} step by step."]

TOPICS = ["a rainy day in the city", "the first day at a new job", "a trip to the mountains", "friendship", "a lost dog",
          "the future of cities", "learning to cook", "a small bakery", "space travel", "remote work",
          "the importance of sleep", "a summer festival", "recycling", "a local library", "online privacy",
          "a new smartphone", "healthy eating", "a volunteer project", "public transport", "an old lighthouse",
          "electric cars", "a family reunion", "moving to another country", "a garden in spring", "time management",
          "social media", "a museum visit", "learning a language", "a football match", "a winter morning"]
WRITING_FORMS = ["Write a short story about {t}.", "Write a poem about {t}.", "Write a blog post about {t}.",
                 "Write a persuasive paragraph about {t}.", "Draft a professional email about {t}.",
                 "Write a product description inspired by {t}.", "Write a speech about {t}.",
                 "Write a diary entry about {t}.", "Write three tips about {t}.", "Write a limerick about {t}.",
                 "Compose a letter to a friend about {t}.", "Write a news headline and a short article about {t}."]
CHARACTERS = ["a pirate captain", "Sherlock Holmes", "a medieval knight", "a friendly robot", "a famous chef",
              "an astronaut on Mars", "a wise old wizard", "a sports coach", "a tour guide in Rome", "a detective",
              "a kindergarten teacher", "a startup founder", "a Shakespearean actor", "a travel blogger"]
ROLE_QUESTIONS = ["What do you think about modern technology?", "How do you spend a typical day?",
                  "What advice would you give to a young person?", "What is your greatest achievement?",
                  "Describe your favorite place.", "What worries you the most?", "How do you deal with failure?"]
HUMANITIES = ["the causes of the French Revolution", "the influence of the printing press", "the Renaissance",
              "the role of museums in society", "the ethics of artificial intelligence", "globalization",
              "the history of democracy", "the Industrial Revolution", "the importance of philosophy",
              "the cultural impact of music", "the Silk Road", "the fall of the Roman Empire",
              "human rights", "the role of art in politics", "the history of the Olympic Games"]
HUMANITIES_FORMS = ["Discuss {t}.", "What were the main effects of {t}?", "Give an overview of {t}.",
                    "Explain the significance of {t} in a few paragraphs."]

TRIVIA = [
    ("Who wrote {x}?", ["Pride and Prejudice", "Hamlet", "War and Peace", "The Great Gatsby", "1984", "Moby-Dick",
                        "The Odyssey", "Don Quixote", "Harry Potter", "The Hobbit", "Frankenstein", "Jane Eyre"]),
    ("What is the capital of {x}?", ["France", "Japan", "Canada", "Australia", "Brazil", "Kenya", "Norway", "Egypt",
                                     "India", "Mexico", "Argentina", "Thailand", "Poland", "Chile", "Vietnam"]),
    ("When did {x} happen?", ["the first moon landing", "the fall of the Berlin Wall", "World War I",
                              "the signing of the Magna Carta", "the French Revolution", "the Great Depression"]),
    ("Who invented {x}?", ["the telephone", "the light bulb", "the printing press", "the airplane", "penicillin",
                           "the World Wide Web", "the steam engine", "dynamite", "the radio"]),
    ("Where is {x} located?", ["the Eiffel Tower", "Mount Everest", "the Great Barrier Reef", "Machu Picchu",
                               "the Taj Mahal", "the Sahara Desert", "Stonehenge", "the Amazon rainforest"]),
    ("What is the largest {x} in the world?", ["ocean", "desert", "country", "animal", "planet in the solar system",
                                               "lake", "city by population", "island"]),
    ("Who was {x}?", ["Napoleon Bonaparte", "Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Cleopatra",
                      "Albert Einstein", "Genghis Khan", "Ada Lovelace", "Mahatma Gandhi", "Frida Kahlo"]),
    ("How many {x}?", ["players are on a soccer team", "bones are in the human body", "planets are in the solar system",
                       "strings does a violin have", "states are in the United States", "keys does a piano have"]),
]

SUMMARY_ASKS = ["Summarize: ", "Summarize the following text in a few sentences:\n", "Write a short summary:\n",
                "What are the main points of this article?\n", "Give a one-paragraph summary of this passage:\n",
                "TL;DR:\n"]
PASSAGE_QUESTIONS = ["What is this passage about?", "According to the passage, what happened?",
                     "Who is mentioned in the passage and why?", "What is the main claim of the text?",
                     "List three facts from the passage."]


def math_prompts(r: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        t = r.choice(MATH_TEMPLATES)
        out.append(t(r, r.choice(NAMES), r.choice(ITEMS), r.choice(PLACES), r.randint(2, 12), r.randint(2, 9),
                     r.randint(2, 6)))
    for _ in range(n // 4):
        p = r.choice(PUZZLES)
        a, b, c = r.sample(["cats", "mammals", "pets", "birds", "animals", "roses", "flowers", "students", "artists"], 3)
        start = r.randint(1, 9)
        seq = ", ".join(str(start * (k + 1) ** r.choice((1, 2))) for k in range(4))
        out.append(p.format(a=a, b=b, c=c, n=r.choice(NAMES), m=r.choice(NAMES), o=r.choice(NAMES),
                            x=r.randint(5, 40), y=r.randint(30, 120) * 2, s=seq,
                            d=r.choice(["Monday", "Tuesday", "Friday", "Sunday"])))
    for _ in range(n // 3):
        out.append(f"Write a {r.choice(LANGS)} function to {r.choice(CODING)}.")
    for _ in range(n // 3):
        out.append(r.choice(STEM_FORMS).format(t=r.choice(STEM)))
    return out


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4]


def extraction_prompts(r: random.Random, train: list[dict], n: int) -> list[str]:
    docs = [q["turns"][0].split(":", 1)[1].strip() for q in train if q["category"] == "summarization"]
    docs += [q["turns"][0] for q in train if q["category"] == "rag"]
    out = []
    for _ in range(n):
        s = _sentences(r.choice(docs))
        if len(s) < 3:
            continue
        start = r.randrange(len(s))
        passage = " ".join(s[start:start + r.randint(3, 12)])
        if r.random() < 0.6:
            out.append(r.choice(SUMMARY_ASKS) + passage)
        else:
            out.append(f"{passage}\n{r.choice(PASSAGE_QUESTIONS)}")
    for _ in range(n // 2):
        template, fills = r.choice(TRIVIA)
        out.append(template.format(x=r.choice(fills)))
    return out


def language_prompts(r: random.Random, train: list[dict], n: int) -> list[str]:
    german = [q["turns"][0].split(":", 1)[1].strip() for q in train if q["category"] == "translation"]
    clauses = [c.strip() for g in german for c in re.split(r"\s[,;]\s|\s(?:und|aber|weil|dass)\s", g)
               if len(c.split()) >= 4]
    out = []
    for _ in range(n // 2):
        pick = r.random()
        text = r.choice(clauses) if pick < 0.4 else " ".join(r.sample(german, 2)) if pick < 0.7 else r.choice(german)
        out.append(f"Translate German to English: {text}")
    for _ in range(n // 2):
        kind = r.random()
        if kind < 0.5:
            out.append(r.choice(WRITING_FORMS).format(t=r.choice(TOPICS)))
        elif kind < 0.75:
            out.append(f"Pretend to be {r.choice(CHARACTERS)}. {r.choice(ROLE_QUESTIONS)}")
        else:
            out.append(r.choice(HUMANITIES_FORMS).format(t=r.choice(HUMANITIES)))
    return out


def main(questions: str, out: str, per_domain: int = 1000) -> None:
    _, train = split_dev(read_questions(questions))
    r = random.Random(0)
    made = {"math": math_prompts(r, per_domain // 2),
            "extraction": extraction_prompts(r, train, per_domain // 3 * 2),
            "language": language_prompts(r, train, per_domain)}
    out_dir = Path(out)
    for name, prompts in made.items():
        unique = list(dict.fromkeys(prompts))  # templates repeat; each prompt once
        (out_dir / f"synthetic-{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in unique))
        print(f"synthetic-{name}: {len(unique)} prompts")


if __name__ == "__main__":
    main(*sys.argv[1:3])
