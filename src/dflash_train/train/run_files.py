"""The files a run keeps in its folder beside the checkpoints: config.yaml (the resolved config,
with what the run found out) and metrics.jsonl (train/metrics_log.py), checked before a run
writes there, so that a file a person wrote is never replaced.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from dflash_train.drafter.config import DrafterConfig
from dflash_train.train import setup
from dflash_train.train.config import TrainConfig
from dflash_train.train.metrics_log import read_records
from dflash_train.utils.config import to_dict
from dflash_train.utils.errors import OutputError

log = logging.getLogger(__name__)

# in the config.yaml a run writes, never in a config a user writes: the drafter and the data as resolved
RESOLVED_KEY, DATA_KEY = TrainConfig.RUN_RECORD_KEYS


def check_run_files(output_dir: Path) -> None:
    """Before a run writes into `output_dir`: a metrics.jsonl there must hold only metrics
    (read_records names a bad line), and a config.yaml there must be one a run wrote (it has
    RESOLVED_KEY, which a config a person writes does not have): a user's own config is never replaced."""
    if (output_dir / "metrics.jsonl").is_file():
        read_records(output_dir / "metrics.jsonl")
    config = output_dir / "config.yaml"
    if not config.exists():
        return
    data = _read_mapping(config)
    if data is None or RESOLVED_KEY not in data:
        raise OutputError(f"{config} is not a config a run wrote (a run writes its resolved config there, and this "
                          f"one would be replaced): choose another run.output_dir, or move the file")


def saved_config(checkpoint: Path) -> dict:
    """The resolved config a checkpoint recorded ({} when it cannot be read)."""
    return _read_mapping(checkpoint / "config.yaml") or {}


def _read_mapping(path: Path) -> dict | None:
    """A YAML file's mapping; None when it cannot be read or holds something else."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def resolved_config(cfg: TrainConfig, drafter_config: DrafterConfig, init_layers: list[int] | None,
                    data_identity: dict) -> dict:
    """What a run writes to its config.yaml and into each checkpoint: its options, and what it resolved
    (the drafter's taps and mask token, the layers it started from, the data's identity)."""
    drafter = {"target_layer_ids": drafter_config.target_layer_ids, "mask_token_id": drafter_config.mask_token_id,
               "init_from_target_layers": init_layers}
    data = {k.split(".", 1)[1]: v for k, v in data_identity.items() if k.startswith(f"{DATA_KEY}.")}
    return {**to_dict(cfg), RESOLVED_KEY: drafter, DATA_KEY: data}


def write_run_config(output_dir: Path, resolved: dict, resume_from: Path | None) -> None:
    """config.yaml of the run folder; on --resume, a hand-edited one is kept aside first (keep_edited_config)."""
    edited = keep_edited_config(output_dir, resume_from, resolved) if resume_from else None
    if edited is not None:
        kept, lost = edited
        log.warning("%s/config.yaml was edited (%s) and this run does not take those values: a run reads "
                    "its config from --config and the options, not from its folder; the edited file is "
                    "kept as %s", output_dir, ", ".join(lost[:4]) + (" ..." if len(lost) > 4 else ""), kept.name)
    (output_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))


def keep_edited_config(output_dir: Path, checkpoint: Path, new: dict) -> tuple[Path, list[str]] | None:
    """Before a resumed run writes its config.yaml (`new`): when the run folder's config.yaml holds values
    the checkpoint did not record and `new` does not carry (edited by hand: a run reads its config from
    --config and the options only), move it aside to config.yaml.edited (-2, -3, ...); returns where, and
    the edited keys lost otherwise. None when nothing would be lost."""
    path = output_dir / "config.yaml"
    if not path.is_file() or not (checkpoint / "config.yaml").is_file():
        return None
    ours = _read_mapping(path)
    flat_saved, flat_new = setup.flatten(saved_config(checkpoint)), setup.flatten(to_dict(new))
    flat_ours = setup.flatten(ours) if ours is not None else {"(not a YAML mapping)": None}
    edited = [k for k, v in flat_ours.items() if k not in flat_saved or flat_saved[k] != v]
    lost = sorted(k for k in edited if k not in flat_new or flat_new[k] != flat_ours[k])
    if not lost:
        return None
    kept, k = output_dir / "config.yaml.edited", 1
    while kept.exists():
        k += 1
        kept = output_dir / f"config.yaml.edited-{k}"
    path.rename(kept)
    return kept, lost
