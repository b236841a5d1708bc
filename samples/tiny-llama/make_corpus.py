"""Generate the tiny-llama corpus: short English stories from a seeded grammar.

Why generated: it needs no download, carries no licence terms (the grammar and its output are
part of this repository, Apache-2.0), and is byte-identical on every machine. Every story is one
line. The four splits are drawn from independent seeded streams and then de-duplicated against
each other, so calibration and evaluation text never appear in training and never overlap.

    python samples/tiny-llama/make_corpus.py            # writes samples/tiny-llama/data/

Files: train.txt / valid.txt (regenerated, not committed), calib.txt, eval.txt, eval.jsonl
(committed, small).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

# --- vocabulary ---------------------------------------------------------------------------
GIRLS = [
    "Anna", "Mia", "Lily", "Sara", "Emma", "Nora", "Ruby", "Zoe", "Ella", "Maya", "Ivy", "Lucy",
    "Clara", "Rosa", "Jade", "Hana", "Tess", "Amy", "Kate", "Lena", "Alice", "Bella", "Chloe",
    "Daisy", "Eva", "Fiona", "Grace", "Holly", "Iris", "Julia", "Kira", "Laura", "Molly", "Nina",
    "Olivia", "Penny", "Quinn", "Rachel", "Sofia", "Tara", "Uma", "Vera", "Wendy", "Yara", "Zara",
    "Aisha", "Beatrice", "Camila", "Delia", "Esther", "Freya", "Gemma", "Harriet", "Ingrid",
    "Josephine", "Leila", "Matilda", "Naomi", "Phoebe", "Rebecca", "Sienna", "Talia", "Violet",
    "Willow", "Yasmin", "Priya", "Mei", "Elena", "Greta", "Martha",
]
BOYS = [
    "Tom", "Ben", "Sam", "Leo", "Max", "Jack", "Noah", "Finn", "Omar", "Eli", "Hugo", "Theo",
    "Raj", "Luca", "Owen", "Kai", "Dan", "Paul", "Ravi", "Joe", "Adam", "Bruno", "Carlos", "David",
    "Ethan", "Felix", "George", "Henry", "Isaac", "James", "Kevin", "Liam", "Marco", "Nathan",
    "Oscar", "Peter", "Quentin", "Robert", "Simon", "Victor", "William", "Xavier", "Yusuf",
    "Zachary", "Arthur", "Benjamin", "Charlie", "Dmitri", "Edward", "Frederick", "Gabriel",
    "Harold", "Ibrahim", "Jonah", "Lucas", "Martin", "Nicholas", "Patrick", "Rupert", "Stefan",
    "Timothy", "Walter", "Hiro", "Mateo", "Andre", "Colin", "Desmond", "Elliot", "Franklin",
    "Gordon",
]
ANIMALS = [
    "cat", "dog", "rabbit", "fox", "bear", "owl", "duck", "mouse", "frog", "horse", "goat",
    "squirrel", "turtle", "bird", "pig", "lion", "deer", "hedgehog", "kitten", "puppy", "penguin",
    "elephant", "giraffe", "monkey", "zebra", "tiger", "dolphin", "kangaroo", "beaver", "raccoon",
    "otter", "badger", "butterfly", "ladybug", "caterpillar", "parrot", "pelican", "octopus",
    "lamb", "pony", "chicken", "goose", "swan", "crab", "snail", "lizard", "wolf", "camel",
]
ANIMAL_NAMES = [
    "Whiskers", "Biscuit", "Pepper", "Clover", "Patch", "Button", "Maple", "Ziggy", "Pip", "Socks",
    "Honey", "Bramble", "Noodle", "Pickle", "Muffin", "Sprout", "Thistle", "Acorn", "Cinnamon",
    "Dumpling", "Fudge", "Gizmo", "Jellybean", "Marble", "Nutmeg", "Pumpkin", "Rascal", "Snowball",
    "Tumble", "Waffle",
]
PLACES = [
    "the park", "the forest", "the beach", "the garden", "the farm", "the river", "the village",
    "the market", "the hill", "the school", "the library", "the lake", "the old barn",
    "the meadow", "the town square", "the bakery", "the harbor", "the mountain", "the zoo",
    "the playground", "the castle", "the cave", "the island", "the desert", "the orchard",
    "the bridge", "the station", "the museum", "the kitchen", "the attic", "the swamp",
    "the valley", "the lighthouse", "the camp", "the pond", "the jungle", "the workshop",
    "the greenhouse", "the carnival", "the stable", "the backyard", "the cottage", "the waterfall",
    "the hospital", "the post office", "the theater", "the cliff", "the field", "the tower",
    "the bookshop",
]
OBJECTS = [
    "ball", "kite", "box", "hat", "book", "map", "key", "cup", "shell", "stone", "boat", "drum",
    "lamp", "ring", "basket", "flower", "letter", "bell", "blanket", "bicycle", "cake", "apple",
    "feather", "coin", "candle", "scarf", "toy train", "picture", "jar of honey", "red balloon",
    "umbrella", "compass", "whistle", "lantern", "puzzle", "sandwich", "pencil", "crayon",
    "notebook", "button", "marble", "ribbon", "helmet", "backpack", "teapot", "spoon", "guitar",
    "violin", "trumpet", "telescope", "magnet", "rope", "ladder", "bucket", "shovel", "pillow",
    "mirror", "clock", "necklace", "sweater", "mitten", "boot", "seed", "pebble", "acorn",
    "pumpkin", "snowman", "sandcastle", "treasure chest", "paper boat", "glass bottle",
    "music box", "silver spoon", "wooden sword", "rocking chair", "birthday card", "fishing rod",
    "paint brush", "butterfly net", "wind chime",
]
ADJ = [
    "big", "small", "red", "blue", "green", "yellow", "shiny", "old", "new", "soft", "heavy",
    "tiny", "bright", "strange", "pretty", "broken", "golden", "warm", "funny", "quiet", "wooden",
    "striped", "little", "enormous", "sparkly", "fluffy", "smooth", "rough", "muddy", "dusty",
    "silver", "purple", "orange", "spotted", "curly", "gentle", "lovely", "magical", "mysterious",
    "precious", "favorite", "ancient", "colorful", "cozy", "delicate", "fancy", "glowing",
    "peculiar", "sturdy", "wobbly", "crooked", "squeaky",
]
FEELINGS = [
    "happy", "sad", "scared", "curious", "tired", "excited", "angry", "proud", "worried",
    "surprised", "calm", "lonely", "brave", "sleepy", "hungry", "cheerful", "grumpy", "nervous",
    "shy", "joyful", "thoughtful", "confused", "hopeful", "silly", "restless", "gloomy",
    "delighted", "frightened", "impatient", "embarrassed",
]
WEATHER = [
    "sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy", "foggy", "bright",
]
TIMES = [
    "One morning", "One day", "Once upon a time", "Last summer", "On a {w} day",
    "Early one evening", "Long ago", "One afternoon", "On Sunday", "In the winter",
]
RELATIVES = [
    "mom", "dad", "grandma", "grandpa", "sister", "brother", "aunt", "uncle", "friend", "teacher",
    "neighbor", "cousin", "grandmother", "grandfather", "baby brother", "baby sister",
    "best friend", "classmate", "coach", "babysitter",
]
ACTIONS = [
    "play", "run", "dance", "sing", "read", "draw", "swim", "jump", "climb", "paint",
    "build a fort", "look for bugs", "fly a kite", "bake cookies", "count the stars",
    "plant flowers", "ride a bike", "feed the ducks", "collect shells", "tell stories", "whistle",
    "skip rope", "pick berries", "watch the clouds", "make music", "explore caves", "write poems",
    "catch fireflies", "sail boats", "knit scarves",
]
PAST = {
    "play": "played", "run": "ran", "dance": "danced", "sing": "sang", "read": "read",
    "draw": "drew", "swim": "swam", "jump": "jumped", "climb": "climbed", "paint": "painted",
    "build a fort": "built a fort", "look for bugs": "looked for bugs",
    "fly a kite": "flew a kite", "bake cookies": "baked cookies",
    "count the stars": "counted the stars", "plant flowers": "planted flowers",
    "ride a bike": "rode a bike", "feed the ducks": "fed the ducks",
    "collect shells": "collected shells", "tell stories": "told stories", "whistle": "whistled",
    "skip rope": "skipped rope", "pick berries": "picked berries",
    "watch the clouds": "watched the clouds", "make music": "made music",
    "explore caves": "explored caves", "write poems": "wrote poems",
    "catch fireflies": "caught fireflies", "sail boats": "sailed boats",
    "knit scarves": "knitted scarves",
}
FOODS = [
    "bread", "soup", "berries", "carrots", "cheese", "pie", "rice", "pancakes", "plums", "nuts",
    "corn", "cookies", "strawberries", "blueberries", "muffins", "sandwiches", "noodles",
    "potatoes", "tomatoes", "oranges", "bananas", "grapes", "peaches", "cherries", "porridge",
    "yogurt", "lemonade", "chocolate", "waffles", "dumplings", "spaghetti", "pretzels",
]
COLORS = [
    "red", "blue", "green", "yellow", "purple", "orange", "pink", "white", "brown", "gray",
    "black", "golden", "silver", "violet", "crimson", "turquoise", "lavender",
]
NUMBERS = [
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
]

def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class Person:
    def __init__(self, rng: random.Random):
        kind = rng.random()
        if kind < 0.4:
            self.name, self.he, self.him, self.his = rng.choice(GIRLS), "she", "her", "her"
        elif kind < 0.8:
            self.name, self.he, self.him, self.his = rng.choice(BOYS), "he", "him", "his"
        else:  # an animal hero
            animal = rng.choice(ANIMALS)
            nm = rng.choice(ANIMAL_NAMES)
            self.name = nm
            self.intro = f"a little {animal} named {nm}"
            self.he, self.him, self.his = "it", "it", "its"
            return
        kinds = ["little girl", "girl", "kid"] if self.he == "she" else ["little boy", "boy", "kid"]
        self.intro = f"a {rng.choice(kinds)} named {self.name}"

    @property
    def He(self) -> str:
        return self.he.capitalize()

    @property
    def His(self) -> str:
        return self.his.capitalize()


def story(rng: random.Random) -> str:
    """One short story: setting, want, problem, help, resolution, moral."""
    hero = Person(rng)
    friend = Person(rng)
    while friend.name == hero.name:
        friend = Person(rng)
    place = rng.choice(PLACES)
    obj = rng.choice(OBJECTS)
    adj = rng.choice(ADJ)
    when = rng.choice(TIMES).format(w=rng.choice(WEATHER))
    act = rng.choice(ACTIONS)
    feel1, feel2 = rng.sample(FEELINGS, 2)
    rel = rng.choice(RELATIVES)
    s: list[str] = []

    s.append(rng.choice([
        f"{when}, there was {hero.intro}.",
        f"{when}, {hero.intro} went to {place}.",
        f"{when}, {hero.intro} lived near {place}.",
    ]))
    s.append(rng.choice([
        f"{hero.He} loved to {act} with {hero.his} {rel}.",
        f"{hero.He} had {a(adj)} {obj} that {hero.he} liked very much.",
        f"The weather was {rng.choice(WEATHER)}, and {hero.he} felt {feel1}.",
        f"Every day {hero.he} wanted to {act} at {place}.",
        f"{hero.His} {rel} had given {hero.him} {a(adj)} {obj} for {hero.his} birthday.",
        f"{hero.He} liked to eat {rng.choice(FOODS)} and to {act} with {hero.his} {rel}.",
        f"Near {place} there was {a(rng.choice(ADJ))} {rng.choice(ANIMALS)} "
        f"that was always {rng.choice(FEELINGS)}.",
    ]))
    # the problem
    problem = rng.randrange(5)
    if problem == 0:
        s.append(f"But one day {hero.he} lost {hero.his} {adj} {obj} at {place}.")
        s.append(f"{hero.He} looked under the trees and behind the rocks, but it was gone.")
        fix = f"found the {obj} next to {a(rng.choice(ADJ))} {rng.choice(OBJECTS)}"
    elif problem == 1:
        s.append(f"But the {obj} was too high, and {hero.he} could not reach it.")
        s.append(f"{hero.He} jumped and jumped, but {hero.he} was too small.")
        fix = f"lifted {hero.him} up so {hero.he} could get the {obj}"
    elif problem == 2:
        n = rng.choice(NUMBERS)
        food = rng.choice(FOODS)
        s.append(f"{hero.He} ate some {food} after {n} hours of play, "
                 f"but {hero.he} was still hungry.")
        s.append(f"{hero.He} did not know where to find more {food}.")
        fix = f"shared {rng.choice(FOODS)} with {hero.him}"
    elif problem == 3:
        s.append("Then the sky turned dark and it started to rain.")
        s.append(f"{hero.He} was {feel2} because {hero.he} was far from home.")
        fix = f"gave {hero.him} {a(rng.choice(COLORS))} umbrella and walked {hero.him} home"
    else:
        s.append(f"But {hero.his} {obj} was broken, and {hero.he} began to cry.")
        s.append(f"\"I cannot {act.split(' ')[0]} without my {obj},\" {hero.he} said.")
        fix = f"fixed the {obj} with some glue and {a(rng.choice(COLORS))} string"
    # help
    s.append(rng.choice([
        f"Then {friend.intro} came by.",
        f"Just then, {hero.his} friend {friend.name} walked over.",
        f"Soon {friend.intro} saw {hero.him}.",
    ]))
    s.append(rng.choice([
        f"\"Why are you {rng.choice(['sad', 'worried', 'upset', 'crying'])}?\" "
        f"asked {friend.name}.",
        f"\"Can I help you?\" asked {friend.name} with a smile.",
        f"\"Do not worry,\" said {friend.name}. \"I will help you.\"",
    ]))
    s.append(f"{friend.name} {fix}.")
    # resolution and moral
    s.append(rng.choice([
        f"{hero.name} was so {rng.choice(['happy', 'glad', 'thankful', 'proud'])} "
        f"that {hero.he} hugged {friend.name}.",
        f"{hero.name} smiled and said, \"Thank you, {friend.name}!\"",
        f"After that, {hero.name} and {friend.name} {PAST[act]} together at {place}.",
    ]))
    if rng.random() < 0.7:
        s.append(rng.choice([
            "From that day on, they were best friends.",
            f"{hero.name} learned that it is good to ask for help.",
            "They learned that sharing makes everyone happy.",
            f"That night, {hero.name} went to bed {rng.choice(['happy', 'tired', 'smiling'])}.",
            f"{hero.He} never forgot that {rng.choice(WEATHER)} day at {place}.",
        ]))
    return " ".join(s)


def generate(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [story(rng) for _ in range(n)]


# Each split comes from its own seed; the sizes keep committed files small (calib + eval < 0.3 MB)
# and give training about 6 MB of text (about 1.5 M tokens).
SPLITS = {"train": (1, 20000), "valid": (2, 600), "calib": (3, 256), "eval": (4, 256)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "data")
    ap.add_argument("--train-stories", type=int, default=SPLITS["train"][1])
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    seen: set[str] = set()
    sizes = {}
    # Order matters: eval and calib claim their stories first; a story that already appeared
    # in an earlier split is dropped from later ones, so the held-out sets stay held out.
    for split in ("eval", "calib", "valid", "train"):
        seed, n = SPLITS[split]
        if split == "train":
            n = args.train_stories
        lines = []
        for text in generate(seed, n):
            if text not in seen:
                seen.add(text)
                lines.append(text)
        (args.out / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        if split == "eval":
            with open(args.out / "eval.jsonl", "w", encoding="utf-8") as f:
                for text in lines:
                    f.write(json.dumps({"text": text}) + "\n")
        sizes[split] = len(lines)
    print(json.dumps({"out": str(args.out), "stories": sizes}))


if __name__ == "__main__":
    main()
