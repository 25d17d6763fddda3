"""GGUF -> a bf16 Hugging Face folder (config, safetensors, tokenizer), once per machine:
every later step then loads the target in about a second instead of dequantising GGUF."""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.target.loading import load_causal_lm, load_tokenizer

gguf, out = sys.argv[1], Path(sys.argv[2])
t = time.time()
model = load_causal_lm(gguf, dtype=torch.bfloat16)
out.mkdir(parents=True, exist_ok=True)
cfg = model.config.to_dict()
cfg.pop("quantization_config", None)
cfg["dtype"] = "bfloat16"
(out / "config.json").write_text(json.dumps(cfg))
tied = model.config.tie_word_embeddings
state = {k: v.contiguous() for k, v in model.state_dict().items() if not (k == "lm_head.weight" and tied)}
save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
load_tokenizer(gguf).save_pretrained(str(out))
print(f"converted {gguf} -> {out} in {time.time() - t:.1f}s")
