"""Built-in prompts: a varied chat workload made offline, for a target with no dataset.

A draft must learn the target's answers to the kind of traffic it serves. With no
dataset of their own (``dataset.path: null``) a user still needs prompts for the
target to answer (``regenerate``): these are made here, from templates and word lists,
without any download. Twelve task types, each with several phrasings, so the answers
span explanations, lists, step-by-step instructions, code, arithmetic, creative
writing, rewriting, comparisons, translation, advice and follow-up turns::

    explain  howto  list  code  math  write  rewrite  compare  translate  advice
    summarize  classify

Every prompt is a pure function of its id (a hash picks the template and the fillers),
the ids are ``<task>-<n>``, and the task types are interleaved, so the first N prompts
of the file are a balanced sample whatever N is. A fraction gets a second user turn
("Give an example.", "Make it shorter.") and some open with a system prompt; the
assistant turns are left for the target to write: a row is
``{"id", "messages": [user, assistant (content null), user]}`` or ``{"id", "messages":
[user]}``, which ``regenerate`` answers turn by turn (eagle3flow/data/records.py, prompt-only
rows).

CLI::

    python -m eagle3flow.data.builtin_prompts --out prompts.jsonl --count 4000
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import sys
import warnings
from pathlib import Path

from eagle3flow.atomic import write_jsonl
from eagle3flow.config import cli_settings
from eagle3flow.embedded.corpus import first_paragraph, iter_documented_members

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "inflation", "machine learning",
    "the French Revolution", "plate tectonics", "vaccines", "blockchain", "the immune system",
    "climate change", "compound interest", "the Roman Empire", "quantum computing", "DNA",
    "the stock market", "electric cars", "the printing press", "gravity", "supply and demand",
    "the Renaissance", "antibiotics", "solar panels", "the internet", "volcanoes",
    "the theory of evolution", "democracy", "recycling", "the moon landing", "neural networks",
    "the industrial revolution", "earthquakes", "coral reefs", "cryptography", "the human heart",
    "rainbows", "the Great Wall of China", "nuclear energy", "bees and pollination", "jazz music",
    "the Pythagorean theorem", "ocean tides", "the Silk Road", "sleep", "chess openings",
    "the Cold War", "operating systems", "wind turbines", "the periodic table", "dinosaurs",
    "the speed of light", "cloud computing", "the Olympic Games", "caffeine", "hurricanes",
    "the Magna Carta", "relational databases", "glaciers", "the placebo effect", "impressionism",
    "the electoral college", "3D printing", "the nitrogen cycle", "meditation", "the Big Bang",
    "open-source software", "the Amazon rainforest", "interest rates", "telescopes", "tsunamis",
    "Shakespeare's plays", "the metric system", "batteries", "the ancient Egyptians", "migration of birds",
    "public key encryption", "the greenhouse effect", "microplastics", "the Fibonacci sequence", "fermentation",
)
AUDIENCES = ("a five-year-old", "a high school student", "a busy manager", "a beginner",
             "someone who has never heard of it", "a university student", "my grandmother")
HOWTO_TASKS = (
    "make a good cup of coffee", "change a flat tire", "start a vegetable garden",
    "write a cover letter", "prepare for a job interview", "learn a new language quickly",
    "save money on groceries", "set up a Python virtual environment", "train a puppy to sit",
    "improve my sleep", "bake bread at home", "run my first 5k", "organize my closet",
    "negotiate a higher salary", "make a budget", "clean a cast iron pan", "write a research paper",
    "give a good presentation", "back up my computer", "reduce stress at work", "plan a road trip",
    "learn to play the guitar", "make friends in a new city", "cook rice on the stove",
    "use git branches", "study for an exam", "start a podcast", "paint a room", "fix a leaky faucet",
    "write a haiku", "meal prep for a week", "stop procrastinating", "grow tomatoes on a balcony",
    "read more books", "make a website", "take better photos with my phone", "brew green tea",
    "keep houseplants alive", "write unit tests", "set goals for the new year",
)
LIST_SUBJECTS = (
    ("tips for", ("staying focused", "eating healthy", "traveling on a budget", "writing clearly",
                  "working from home", "learning to code", "public speaking", "saving energy at home",
                  "staying motivated", "reducing screen time", "being a good listener", "running a meeting")),
    ("ideas for", ("a rainy day", "a birthday party", "a science fair project", "a short story",
                   "a weekend trip", "a team-building activity", "a healthy breakfast", "a podcast episode",
                   "a mobile app", "a family dinner", "a small business", "a gift for a friend")),
    ("reasons to", ("learn history", "exercise regularly", "read fiction", "learn statistics",
                    "visit a museum", "drink water", "keep a journal", "learn to cook", "volunteer",
                    "use version control", "travel alone", "study math")),
    ("examples of", ("renewable energy sources", "mammals that live in the ocean", "programming languages",
                     "famous inventions", "prime numbers", "figures of speech", "chemical reactions in daily life",
                     "board games", "simple machines", "musical instruments", "sorting algorithms",
                     "ancient civilizations")),
)
COUNTS = ("three", "four", "five", "six", "seven")
CODE_SPECS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list while keeping the order",
    "computes the factorial of n", "checks whether a string is a palindrome", "finds the largest element in a list",
    "converts Celsius to Fahrenheit", "flattens a nested list", "counts word frequencies in a text",
    "returns the greatest common divisor of two numbers", "sorts a list of dictionaries by a key",
    "checks whether two strings are anagrams", "computes the average of a list of numbers",
    "reads a CSV file and returns its rows", "validates an email address with a regular expression",
    "implements binary search", "transposes a matrix", "returns all permutations of a list",
    "computes the sum of the digits of an integer", "capitalizes every word in a sentence",
    "finds the second largest number in a list", "converts a Roman numeral to an integer",
    "implements a stack class with push and pop", "chunks a list into pieces of size n",
    "returns the intersection of two lists", "computes the running total of a list",
    "checks whether brackets in a string are balanced",
)
CODE_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "Python", "C", "Rust", "Go")
WRITE_FORMS = ("a short poem", "a haiku", "a short story", "a limerick", "a product description",
               "a tweet", "a formal email", "a thank-you note", "a motivational speech", "a diary entry",
               "a news headline and a one-paragraph article", "a recipe", "a song chorus", "a fable")
WRITE_SUBJECTS = ("autumn", "a lonely robot", "the ocean", "a city at night", "friendship", "a lost cat",
                  "the first day of school", "a rainy morning", "a dragon who is afraid of fire",
                  "space travel", "a coffee shop", "a mountain hike", "an old bookstore", "winter",
                  "a time traveler", "a new smartphone", "a garden in spring", "a football match")
REWRITE_SENTENCES = (
    "the meeting got moved to tomorrow because the boss is sick",
    "we didnt finish the project on time cause we had too many bugs",
    "this product is really good and i like it a lot and you should buy it",
    "the weather was bad so we stayed home and watched movies all day",
    "i think that maybe we should consider possibly changing the plan",
    "the results of the experiment was not what we expected at all",
    "please send me the report as soon as you can thanks",
    "our team have been working very hard on the new features",
    "he said he will come but he never came and didnt call",
    "the new update makes the app slower and it crashes sometimes",
    "learning to code is hard at first but it gets easier with practice",
    "the restaurant was nice but the food took forever to arrive",
)
REWRITE_STYLES = ("so that it sounds more formal", "so that it is more concise", "to be more polite",
                  "in the passive voice", "for a children's book", "with correct grammar and punctuation",
                  "to be more persuasive", "as a question", "in the past tense")
COMPARE_PAIRS = (
    ("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"),
    ("TCP", "UDP"), ("stocks", "bonds"), ("RAM", "storage"), ("a crocodile", "an alligator"),
    ("speed", "velocity"), ("a democracy", "a republic"), ("mitosis", "meiosis"),
    ("machine learning", "traditional programming"), ("an LED", "an incandescent bulb"),
    ("baking soda", "baking powder"), ("a comet", "an asteroid"), ("HTTP", "HTTPS"),
    ("empathy", "sympathy"), ("a lake", "a pond"), ("SQL", "NoSQL databases"),
    ("renting", "buying a home"), ("tea", "coffee"), ("a simile", "a metaphor"),
    ("nuclear fission", "nuclear fusion"), ("git merge", "git rebase"), ("a hurricane", "a tornado"),
)
PHRASES = ("good morning", "where is the train station?", "thank you very much", "how much does this cost?",
           "I would like a cup of coffee", "the weather is nice today", "nice to meet you",
           "can you help me?", "I am learning a new language", "see you tomorrow",
           "what time is it?", "I love reading books", "my name is Anna", "the bill, please",
           "I am looking for a pharmacy", "how was your weekend?", "happy birthday", "I don't understand",
           "where can I buy a ticket?", "the museum opens at nine", "I'm allergic to nuts",
           "could you speak more slowly?", "we are going to the beach", "this is my first visit")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Japanese", "Swedish")
ADVICE = (
    "I have two job offers, one pays more and the other has a shorter commute. How should I decide?",
    "My roommate never cleans the kitchen. How can I bring it up without a fight?",
    "I want to learn programming but I only have 30 minutes a day. Where should I start?",
    "I get nervous before exams even when I studied. What can I do?",
    "Should I learn Python or JavaScript first?",
    "How can I stay productive when working from home with kids?",
    "I keep buying gym memberships and never go. Any advice?",
    "What should I consider before adopting a dog?",
    "How do I ask my manager for feedback on my work?",
    "I want to start investing with a small amount of money. What should I know?",
    "How can I become better at remembering names?",
    "My code works but my colleagues say it is hard to read. How can I improve?",
    "I'm moving to a new country next month. How should I prepare?",
    "How do I politely decline an invitation to a party?",
    "What is a good way to learn touch typing?",
)
ADVICE_PEOPLE = ("a student", "a retiree", "a new parent", "a software engineer", "a nurse", "a teenager",
                 "a small business owner", "someone who just moved abroad")
ADVICE_CHOICES = (("rent", "buy a car"), ("study abroad", "stay home for university"),
                  ("learn the piano", "learn the guitar"), ("take a gap year", "start college right away"),
                  ("work at a startup", "work at a large company"), ("get a cat", "get a dog"),
                  ("use a laptop", "use a desktop for programming"), ("run in the morning", "run in the evening"),
                  ("read the book first", "watch the movie first"), ("freelance", "find a full-time job"))
CLASSIFY_ITEMS = (
    ("Is a tomato a fruit or a vegetable?", None),
    ("Is a whale a fish or a mammal?", None),
    ("Classify these animals as mammals, birds or reptiles: eagle, snake, dolphin, penguin, lizard, bat.", None),
    ("Is the following review positive or negative? \"{review}\"", "review"),
    ("What is the sentiment of this message: \"{review}\"", "review"),
    ("Which of these are programming languages: Python, Cobra, Java, Borneo, Rust, Ruby, Jade?", None),
    ("Sort these planets by their distance from the sun: Mars, Venus, Jupiter, Earth, Mercury.", None),
    ("Is 91 a prime number? Explain.", None),
    ("Is \"{thing}\" a fruit, a vegetable, an animal, a tool or a vehicle?", "thing"),
    ("Which word does not belong with the others: {odd}? Why?", "odd"),
)
THINGS = ("carrot", "hammer", "bicycle", "banana", "otter", "screwdriver", "spinach", "truck", "mango",
          "giraffe", "wrench", "broccoli", "canoe", "peach", "hedgehog", "saw", "onion", "scooter",
          "cherry", "owl")
ODD_ONES = ("apple, banana, carrot, grape", "red, blue, green, happy", "Paris, London, Tokyo, Amazon",
            "violin, cello, trumpet, viola", "Monday, Friday, March, Sunday", "oak, pine, rose, maple",
            "square, triangle, circle, cube", "copper, iron, plastic, gold", "shark, dolphin, whale, tuna",
            "Python, Java, Excel, Rust")
REVIEWS = ("The battery died after two days and support never answered.",
           "Absolutely loved the hotel, the staff were kind and the room was spotless.",
           "The movie was fine, nothing special but not bad either.",
           "Best pizza I have had in years, will come back!",
           "The package arrived late and the box was crushed.",
           "It does what it says, and the price is fair.",
           "I waited an hour and nobody took my order.",
           "The course was clear, practical and worth every minute.",
           "Not sure how I feel about the ending of this book.",
           "The new update fixed every problem I had, great job.",
           "Too expensive for what you get.",
           "My kids love this game and so do I.")
SUMMARIZE_TEXTS = (
    "The city council met on Tuesday to discuss the new bike lanes. Supporters said the lanes would make "
    "cycling safer and reduce traffic, while some shop owners worried about losing parking spaces. After a "
    "long debate the council voted to build the lanes on two main streets as a one-year trial.",
    "Honeybees communicate the location of food through a behavior called the waggle dance. A worker bee "
    "returning to the hive moves in a figure-eight pattern; the angle of the dance shows the direction of the "
    "food relative to the sun, and the length of the waggle shows the distance.",
    "The company reported higher sales this quarter, driven mostly by its new line of budget laptops. "
    "However, profits fell slightly because of rising component costs and higher shipping prices. The CEO "
    "said the company expects costs to stabilize next year.",
    "Regular physical activity improves heart health, strengthens muscles and bones, and can reduce the risk "
    "of many chronic diseases. Experts recommend at least 150 minutes of moderate exercise per week, such as "
    "brisk walking, cycling or swimming, along with muscle-strengthening activities twice a week.",
    "Version control systems record changes to files over time so that you can recall specific versions "
    "later. They let several people work on the same project, show who changed what and when, and make it "
    "possible to undo mistakes by going back to an earlier state.",
    "The first telescopes were built in the Netherlands in the early 1600s. Galileo soon improved the design "
    "and used it to observe the moons of Jupiter, the phases of Venus and the craters of the Moon, findings "
    "that supported the idea that the Earth orbits the Sun.",
)
FOLLOW_UPS = ("Can you give me an example?", "Can you make that shorter?", "Why is that?",
              "Can you explain that in simpler words?", "What else should I know?",
              "Can you put that into a numbered list?", "Thanks! Can you summarize it in one sentence?")
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a friendly and concise assistant.",
                  "You are an expert tutor who explains things step by step.")
NAMES = ("Alice", "Ben", "Chen", "Dana", "Omar", "Priya", "Sofia", "Tom")
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards")


@functools.cache
def _documentation_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs of Python's stdlib docstrings (present on every machine), for the
    summarize task: a few hundred real texts of 20 to 120 words, in a fixed order."""
    paragraphs, seen = [], set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _, _, _, doc in iter_documented_members(DOCUMENTED_MODULES):
            text = first_paragraph(doc)
            if 20 <= len(text.split()) <= 120 and text not in seen:
                seen.add(text)
                paragraphs.append(text)
    return tuple(paragraphs)


DOCUMENTED_MODULES = ("argparse", "collections", "csv", "datetime", "decimal", "email.message", "fractions",
                      "functools", "heapq", "http.client", "itertools", "json", "logging", "pathlib", "random",
                      "shutil", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
                      "threading", "unittest", "urllib.parse", "uuid", "zipfile")


def _pick(key: str, salt: str, options):
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return options[int.from_bytes(digest[:8], "big") % len(options)]


def _number(key: str, salt: str, low: int, high: int) -> int:
    return _pick(key, salt, range(low, high + 1))


def _math(key: str) -> str:
    a, b, c = _number(key, "a", 3, 95), _number(key, "b", 2, 40), _number(key, "c", 2, 12)
    name, item = _pick(key, "name", NAMES), _pick(key, "item", ITEMS)
    return _pick(key, "form", (
        f"{name} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {name} have now?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"What is {a} multiplied by {b}? Show your work.",
        f"A shirt costs ${a} and is on sale for {5 * (c % 8 + 1)}% off. What is the sale price?",
        f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
        f"Solve for x: {c}x + {b} = {c * a + b}.",
        f"{name} reads {b} pages a day. How many days does it take to read a {b * c + a}-page book?",
        f"What is {a}% of {b * 20}?",
        f"The sum of two numbers is {a + b} and their difference is {abs(a - b)}. What are the numbers?",
    ))


def _first_turn(task: str, key: str) -> str:
    if task == "explain":
        topic = _pick(key, "topic", TOPICS)
        return _pick(key, "form", (
            f"What is {topic}?", f"Explain {topic} to {_pick(key, 'audience', AUDIENCES)}.",
            f"How does {topic} work?", f"Why is {topic} important?",
            f"Tell me three interesting facts about {topic}.", f"Give me a short overview of {topic}."))
    if task == "howto":
        goal = _pick(key, "task", HOWTO_TASKS)
        return _pick(key, "form", (f"How do I {goal}?", f"What are the steps to {goal}?",
                                   f"Can you give me step-by-step instructions to {goal}?",
                                   f"I want to {goal}. Where do I start?"))
    if task == "list":
        kind, subjects = _pick(key, "kind", LIST_SUBJECTS)
        return _pick(key, "form", (f"Give me {_pick(key, 'n', COUNTS)} {kind} {_pick(key, 's', subjects)}.",
                                   f"List {_pick(key, 'n', COUNTS)} {kind} {_pick(key, 's', subjects)}.",
                                   f"What are some {kind} {_pick(key, 's', subjects)}?"))
    if task == "code":
        spec, language = _pick(key, "spec", CODE_SPECS), _pick(key, "lang", CODE_LANGUAGES)
        return _pick(key, "form", (f"Write a {language} function that {spec}.",
                                   f"How can I write a function in {language} that {spec}?",
                                   f"Show me {language} code that {spec}, and explain how it works."))
    if task == "math":
        return _math(key)
    if task == "write":
        return f"Write {_pick(key, 'form', WRITE_FORMS)} about {_pick(key, 'subject', WRITE_SUBJECTS)}."
    if task == "rewrite":
        return (f"Rewrite this sentence {_pick(key, 'style', REWRITE_STYLES)}: "
                f"\"{_pick(key, 'sentence', REWRITE_SENTENCES)}\"")
    if task == "compare":
        a, b = _pick(key, "pair", COMPARE_PAIRS)
        return _pick(key, "form", (f"What is the difference between {a} and {b}?",
                                   f"Compare {a} and {b}.", f"{a.capitalize()} or {b}: how are they different?"))
    if task == "translate":
        return f"Translate \"{_pick(key, 'phrase', PHRASES)}\" into {_pick(key, 'lang', LANGUAGES)}."
    if task == "advice":
        a, b = _pick(key, "choice", ADVICE_CHOICES)
        return _pick(key, "form", (
            _pick(key, "question", ADVICE), f"Should I {a} or {b}?",
            f"What advice would you give to {_pick(key, 'person', ADVICE_PEOPLE)} who wants to "
            f"{_pick(key, 'goal', HOWTO_TASKS)}?"))
    if task == "summarize":
        texts = SUMMARIZE_TEXTS + _documentation_paragraphs()
        return _pick(key, "form", ("Summarize this text in two sentences:\n\n",
                                   "What is the main point of the following paragraph?\n\n",
                                   "Give me a one-line summary of this:\n\n",
                                   "Explain this documentation in plain words:\n\n")) + _pick(key, "text", texts)
    if task == "classify":
        question, slot = _pick(key, "item", CLASSIFY_ITEMS)
        fillers = {"review": REVIEWS, "thing": THINGS, "odd": ODD_ONES}
        return question.format(**{slot: _pick(key, slot, fillers[slot])}) if slot else question
    raise ValueError(f"unknown task {task!r}")


TASKS = ("explain", "howto", "list", "code", "math", "write", "rewrite", "compare", "translate",
         "advice", "summarize", "classify")


def make_prompt(index: int) -> dict:
    """Prompt ``index`` (0-based): tasks round-robin, every choice a hash of the id."""
    task = TASKS[index % len(TASKS)]
    key = f"{task}-{index // len(TASKS)}"
    messages = []
    if _number(key, "system", 0, 99) < 15:
        messages.append({"role": "system", "content": _pick(key, "system_prompt", SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": _first_turn(task, key)})
    if _number(key, "second_turn", 0, 99) < 20:
        messages.append({"role": "assistant", "content": None})
        messages.append({"role": "user", "content": _pick(key, "follow_up", FOLLOW_UPS)})
    return {"id": key, "task": task, "messages": messages}


def make_prompts(count: int) -> list[dict]:
    """The first ``count`` prompts whose first question is new: a question drawn again (a
    small task runs out of phrasings) is skipped, so no prompt of the train split repeats
    in the eval split."""
    prompts, seen, index = [], set(), 0
    while len(prompts) < count:
        if index > 50 * count + 1000:
            raise ValueError(f"only {len(prompts)} distinct prompts could be made, {count} asked for")
        prompt = make_prompt(index)
        index += 1
        question = next(m["content"] for m in prompt["messages"] if m["role"] == "user")
        if question not in seen:
            seen.add(question)
            prompts.append(prompt)
    return prompts


def write_prompts(path: str | Path, count: int) -> dict:
    """Write ``count`` prompts as JSONL (atomically); returns counts by task."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(count)
    write_jsonl(path, prompts)
    by_task = {}
    for prompt in prompts:
        by_task[prompt["task"]] = by_task.get(prompt["task"], 0) + 1
    return {"prompts": len(prompts), "by_task": by_task,
            "multi_turn": sum(1 for p in prompts if sum(m["role"] == "user" for m in p["messages"]) > 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.builtin_prompts",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config-json", default="{}",
                        help="of the dataset section, builtin_prompts: how many prompts")
    args = parser.parse_args(argv)
    count = cli_settings(parser, "dataset", args.config_json)["builtin_prompts"]
    stats = write_prompts(args.out, count)
    print(f"builtin_prompts: {stats['prompts']} prompts ({stats['multi_turn']} multi-turn) -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
