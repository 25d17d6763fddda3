"""The levers of the target forward that `dflash-train bench --levers` measures, one row each
(docs/performance.md, "The target forward"): name -> (what it is, the BenchConfig fields it sets).

Each is measured alone against `baseline`, then together. Every row names its target forward:
the defaults (auto) would otherwise give the baseline the fast path.
"""

from __future__ import annotations

HF = {"target_forward": "hf", "target_compile": False, "grouped_kv": False}
PACKED_EAGER = {"target_forward": "packed", "target_compile": False, "grouped_kv": False}
LEVERS: dict[str, tuple[str, dict]] = {
    "baseline": ("Hugging Face forward, PyTorch's SDPA choice", HF),
    "hf-flash": ("Hugging Face forward, SDPA forced to flash", {**HF, "sdpa_backend": "flash"}),
    "hf-cudnn": ("Hugging Face forward, SDPA forced to cuDNN", {**HF, "sdpa_backend": "cudnn"}),
    "packed": ("packed forward, eager, PyTorch's SDPA choice", PACKED_EAGER),
    "packed-flash": ("packed forward, eager, SDPA forced to flash", {**PACKED_EAGER, "sdpa_backend": "flash"}),
    "packed-cudnn": ("packed forward, eager, SDPA forced to cuDNN", {**PACKED_EAGER, "sdpa_backend": "cudnn"}),
    "packed-compiled": ("packed forward, compiled, one fixed shape",
                        {"target_forward": "packed", "target_compile": True}),
    "packed-grouped-kv": ("packed forward, eager, attention reading one key/value head per group of query heads",
                          {**PACKED_EAGER, "grouped_kv": True}),
    "fp8-unfused": ("Hugging Face forward + FP8Linear (eager quantisation)", {**HF, "fp8_target": True}),
    "fp8-compiled": ("packed compiled + FP8 (quantisation fused)",
                     {"target_forward": "packed", "target_compile": True, "fp8_target": True}),
    "overlap": ("baseline + next batch's target forward on a second stream", {**HF, "overlap": True}),
    "data-labels": ("baseline with data labels: the target stops after its last tapped layer",
                    {**HF, "labels": "data"}),
    "all-bf16": ("packed compiled + the fastest SDPA kernel of the packed rows + overlap",
                 {"target_forward": "packed", "target_compile": True, "sdpa_backend": "best", "overlap": True}),
    "all-fp8": ("all-bf16 + FP8", {"target_forward": "packed", "target_compile": True, "sdpa_backend": "best",
                                   "overlap": True, "fp8_target": True}),
}


def lever_names(levers: str) -> list[str]:
    if levers.strip() == "all":
        return list(LEVERS)
    return [n.strip() for n in levers.split(",") if n.strip()]
