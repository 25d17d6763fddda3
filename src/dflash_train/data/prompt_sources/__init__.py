"""Training prompts from offline sources, for `dflash-train generate --prompts` (docs/recipe-smollm2.md).

`build.py` runs the job; each source is one module (`python_code.py`, `text_docs.py`,
`math_problems.py`, `long_docs.py`); `guard.py` keeps HumanEval out; `licences.py` says which installed
packages may be read.
"""
