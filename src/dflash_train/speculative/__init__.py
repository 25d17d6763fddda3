"""Speculative decoding with a DFlash drafter on the target's static-KV decoder (generate/decoder.py),
and its measurement (tau, acceptance, speedup, the lossless check); see docs/eval.md."""
