"""Evaluation by real speculative decoding (`dflash-train eval`) and the demo (`dflash-train demo`).

(the decoding itself and its measurement, tau, acceptance and speeds, are in speculative/)
cli.py          the eval job: a drafter on a prompt set, report.json and report.png
report.py       report.json and report.png
demo.py         prepare -> train -> export -> eval on the built-in SmolLM2-135M-Instruct
assets.py       how the demo's shipped data was made
"""
