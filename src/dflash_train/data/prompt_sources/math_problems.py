"""Templated school-level math problems (`math`): arithmetic, fractions, percentages, equations,
number theory, sequences, and word problems about shopping, travel, work, ages, areas and money.

Our own generator: DeepMind's `mathematics_dataset` 1.0.1 (Apache-2.0, the last release) imports
`sympy.solvers.diophantine.base_solution_linear`, which sympy removed in 1.6, and torch needs
sympy >= 1.13, so it cannot be installed beside the trainer. Each template draws its numbers
and names from a `random.Random` seeded with (seed, index), so problem i is the same whatever
the count. Only questions: the target writes every answer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction

from dflash_train.data.prompt_sources.items import PromptItem

NAMES = ("Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Giulia", "Hiro", "Ines", "Jamal", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Vera", "Wei", "Yusuf", "Zoe")
ITEMS = (("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("loaf of bread", "loaves of bread"), ("bottle of water", "bottles of water"), ("book", "books"),
         ("cupcake", "cupcakes"), ("plant", "plants"), ("T-shirt", "T-shirts"))
ASK = ("", "Show your work.", "Explain each step.", "Give the final answer on its own line.",
       "Solve it step by step.")


def _q(rng: random.Random, text: str) -> str:
    tail = rng.choice(ASK)
    return f"{text} {tail}".strip()


def arithmetic(r: random.Random) -> str:
    a, b, c = r.randint(2, 999), r.randint(2, 999), r.randint(2, 30)
    form = r.choice((f"{a} + {b} * {c}", f"({a} - {b}) * {c}", f"{a * c} / {c} + {b}", f"{a} - {b} + {c}",
                     f"{a} * {c} - {b}"))
    return _q(r, f"Calculate {form}.")


def decimals(r: random.Random) -> str:
    a, b = round(r.uniform(0.1, 99), r.choice((1, 2))), round(r.uniform(0.1, 99), r.choice((1, 2)))
    op = r.choice(("+", "-", "*"))
    return _q(r, f"What is {a} {op} {b}?")


def fractions(r: random.Random) -> str:
    x = Fraction(r.randint(1, 11), r.randint(2, 12))
    y = Fraction(r.randint(1, 11), r.randint(2, 12))
    op = r.choice(("+", "-", "times", "divided by"))
    return _q(r, f"Compute {x.numerator}/{x.denominator} {op} {y.numerator}/{y.denominator} and simplify the result.")


def percent(r: random.Random) -> str:
    p, n = r.choice((5, 10, 12, 15, 20, 25, 30, 40, 75)), r.randint(20, 2000)
    return _q(r, r.choice((f"What is {p}% of {n}?", f"A price of ${n} is reduced by {p}%. What is the new price?",
                           f"A town of {n * 10} people grows by {p}% in a year. How many people live there then?")))


def linear_equation(r: random.Random) -> str:
    x, a, b = r.randint(-20, 20), r.randint(2, 12), r.randint(-50, 50)
    var = r.choice("xyzkn")
    return _q(r, f"Solve for {var}: {a}{var} {'+' if b >= 0 else '-'} {abs(b)} = {a * x + b}.")


def system_of_equations(r: random.Random) -> str:
    x, y = r.randint(-9, 9), r.randint(-9, 9)
    a, b, c, d = (r.randint(1, 7) for _ in range(4))
    if a * d == b * c:
        d += 1
    return _q(r, f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and {c}x + {d}y = {c * x + d * y}.")


def quadratic(r: random.Random) -> str:
    p, q = r.randint(-12, 12), r.randint(-12, 12)
    b, c = -(p + q), p * q
    return _q(r, f"Find the roots of x^2 {'+' if b >= 0 else '-'} {abs(b)}x {'+' if c >= 0 else '-'} {abs(c)} = 0.")


def number_theory(r: random.Random) -> str:
    a, b = r.randint(12, 600), r.randint(12, 600)
    return _q(r, r.choice((f"What is the greatest common divisor of {a} and {b}?",
                           f"What is the least common multiple of {a} and {b}?",
                           f"Is {r.randint(100, 9999)} a prime number? Explain how you check.",
                           f"Write {a * b} as a product of prime factors.",
                           f"What is the remainder when {a * b + r.randint(1, 50)} is divided by {a}?")))


def sequence(r: random.Random) -> str:
    start, step, n = r.randint(-20, 40), r.randint(2, 15), r.randint(10, 60)
    if r.random() < 0.5:
        terms = ", ".join(str(start + k * step) for k in range(5))
        return _q(r, f"The sequence {terms}, ... continues the same way. What is its {n}th term?")
    ratio = r.randint(2, 4)
    terms = ", ".join(str(abs(start) + 1) if k == 0 else str((abs(start) + 1) * ratio ** k) for k in range(4))
    return _q(r, f"What is the next number in the sequence {terms}, ...? What is the rule?")


def shopping(r: random.Random) -> str:
    name, (one, many) = r.choice(NAMES), r.choice(ITEMS)
    n, price, paid = r.randint(2, 12), r.randint(1, 25) + r.choice((0, 0.5, 0.25)), r.choice((50, 100, 200))
    return _q(r, f"{name} buys {n} {many} at ${price:.2f} per {one} and pays with a ${paid} bill. "
                 f"How much change does {name} get?")


def travel(r: random.Random) -> str:
    name = r.choice(NAMES)
    speed, hours = r.randint(30, 120), r.randint(2, 9)
    if r.random() < 0.5:
        return _q(r, f"{name} drives at {speed} km/h for {hours} hours and then at {speed - 15} km/h for "
                     f"{hours // 2 + 1} hours. How far does {name} travel in total?")
    return _q(r, f"Two trains leave stations {speed * hours * 2} km apart at the same time and travel toward each "
                 f"other at {speed} km/h and {speed + 20} km/h. After how many hours do they meet?")


def work_rate(r: random.Random) -> str:
    a, b = r.randint(2, 12), r.randint(2, 12)
    x, y = r.sample(NAMES, 2)
    return _q(r, f"{x} can paint a fence in {a} hours and {y} can paint it in {b} hours. "
                 f"How long does it take them working together?")


def ages(r: random.Random) -> str:
    x, y = r.sample(NAMES, 2)
    child, k, later = r.randint(3, 20), r.randint(2, 4), r.randint(2, 15)
    return _q(r, f"{x} is {k} times as old as {y}. In {later} years, {x} will be {k * child + later} years old. "
                 f"How old is {y} now?")


def geometry(r: random.Random) -> str:
    w, h, rad = r.randint(2, 40), r.randint(2, 40), r.randint(1, 20)
    return _q(r, r.choice((f"A rectangle is {w} m long and {h} m wide. What are its area and perimeter?",
                           f"What is the area of a circle with radius {rad} cm? Use pi = 3.14.",
                           f"A right triangle has legs of {w} and {h}. How long is the hypotenuse?",
                           f"A box measures {w} cm by {h} cm by {rad} cm. What is its volume?")))


def money(r: random.Random) -> str:
    p, rate, years = r.randint(1, 50) * 100, r.choice((2, 3, 4, 5, 6, 8)), r.randint(2, 10)
    name = r.choice(NAMES)
    return _q(r, r.choice((f"{name} saves ${p} at {rate}% simple interest per year. How much interest is earned "
                           f"after {years} years?",
                           f"{name} invests ${p} at {rate}% interest compounded yearly. How much is there after "
                           f"{years} years?",
                           f"{name} earns ${p // 10} a week and spends {rate * 5}% of it. How much is saved in "
                           f"{years} weeks?")))


def statistics(r: random.Random) -> str:
    data = [r.randint(1, 100) for _ in range(r.randint(5, 9))]
    return _q(r, f"Find the mean, median and range of these numbers: {', '.join(map(str, data))}.")


def probability(r: random.Random) -> str:
    red, blue = r.randint(1, 12), r.randint(1, 12)
    return _q(r, r.choice((f"A bag holds {red} red and {blue} blue marbles. Two are drawn without replacement. "
                           f"What is the probability that both are red?",
                           f"Two fair dice are rolled. What is the probability that the sum is {r.randint(2, 12)}?",
                           f"A coin is flipped {red + 2} times. What is the probability of exactly {red // 2 + 1} "
                           f"heads?")))


def units(r: random.Random) -> str:
    n = r.randint(2, 500)
    return _q(r, r.choice((f"How many seconds are in {n} minutes and {n % 60} seconds?",
                           f"Convert {n} kilometres to metres and to centimetres.",
                           f"A recipe needs {n} grams of flour for {math.gcd(n, 12) + 2} people. "
                           f"How much flour is needed for {r.randint(3, 20)} people?")))


TEMPLATES: dict[str, Callable[[random.Random], str]] = {
    f.__name__.replace("_", "-"): f for f in (arithmetic, decimals, fractions, percent, linear_equation,
                                               system_of_equations, quadratic, number_theory, sequence, shopping,
                                               travel, work_rate, ages, geometry, money, statistics, probability,
                                               units)}


def math_prompts(count: int, *, seed: int, source: str = "math") -> list[PromptItem]:
    """`count` problems; problem i uses template i mod T (an even mix) with numbers seeded by (seed, i)."""
    names = list(TEMPLATES)
    items = []
    for i in range(count):
        style = names[i % len(names)]
        text = TEMPLATES[style](random.Random(f"{seed}:{i}"))
        items.append(PromptItem(source, style, text, text))
    return items
