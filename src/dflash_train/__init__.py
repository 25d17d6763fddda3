"""dflash-train: train DFlash speculative-decoding drafters for Hugging Face causal LMs."""

__version__ = "0.1.0"
