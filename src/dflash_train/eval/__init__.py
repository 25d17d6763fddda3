"""Evaluation by real speculative decoding (`dflash-train eval`) and the demo (`dflash-train demo`).

(the decoding loop itself, target + drafter KV caches, is speculative/loop.py)
metrics.py      tau, acceptance histogram, per-position acceptance, speeds
prompts.py      built-in prompt sets (held-out chat, HumanEval) and prompt files
run.py          evaluate a drafter on prompts; the trainer's end-of-run check
report.py       report.json and report.png
demo.py         prepare -> train -> export -> eval on the built-in SmolLM2-135M-Instruct
assets.py       how the demo's shipped data was made
"""
