"""Every family through every job, as a user runs them: prepare, train, export, eval, generate.

Each family is a tiny random model saved as a Hugging Face directory with the family's own
chat template and special tokens (tests/families.py, tests/family_templates.py). The jobs run
through `dflash-train`'s entry point in process, with their default options: a job either
succeeds (exit 0) or, where it truly cannot apply, refuses in one line with exit status 2;
never a traceback. What each job must leave behind is checked too: prepared rows for every
conversation with loss on assistant tokens only, a trained and exported drafter, an eval
whose outputs equal plain greedy decoding, generated answers (or the refusal naming the
HTTP engine). Partial acceptance itself, forced over many rounds, is
tests/speculative/test_family_rollback.py's; the loss masks token by token are
tests/data/test_family_templates.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.ipc as ipc
import pytest

from dflash_train.cli import main
from dflash_train.generate.decoder import SUPPORTED_MODEL_TYPES
from dflash_train.target.packed import UnsupportedTarget, check_packed_config
from tests.families import FAMILIES, save_family

pytestmark = pytest.mark.slow

DEMO_CPU = Path(__file__).parents[1] / "src/dflash_train/assets/demo_cpu.yaml"
TOPICS = ["the sea", "a red kite", "three apples", "the moon", "Python lists", "a blue house", "the weather", "bread"]


def _conversations(n: int = 24) -> list[dict]:
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"Tell me about {topic}."},
                     {"role": "assistant", "content": f"Sure. {topic.capitalize()} is nice, and I like {topic}."}]
        if i % 4 == 1:
            messages += [{"role": "user", "content": "And then?"},
                         {"role": "assistant", "content": f"Then we talk about {TOPICS[(i + 1) % len(TOPICS)]}."}]
        rows.append({"messages": messages})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepared_rows(data: Path) -> tuple[int, int]:
    """(rows, loss tokens) over every shard of a prepared dataset."""
    rows = loss = 0
    for shard in sorted(data.glob("shard-*.arrow")):
        table = ipc.open_file(str(shard)).read_all()
        rows += table.num_rows
        loss += sum(sum(m) for m in table.column("loss_mask").to_pylist())
    return rows, loss


def _packed_takes(config) -> bool:
    try:
        check_packed_config(config)
    except UnsupportedTarget:
        return False
    return True


def _train(target: Path, data: Path, run: Path, *extra: str) -> int:
    return main(["train", "--config", str(DEMO_CPU), "--target.path", str(target), "--data.path", str(data),
                 "--run.output_dir", str(run), "--run.device", "cpu", "--run.max_steps", "3", "--run.log_every", "1",
                 "--data.eval_fraction", "0", "--no-run.fit_schedule", "--run.progress", "false", *extra])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_job_runs_on_the_family(name, tmp_path, capsys):
    target = tmp_path / "target"
    model, tokenizer = save_family(name, target)
    model_type = model.config.get_text_config().model_type
    chats = _write_jsonl(tmp_path / "chats.jsonl", _conversations())
    prompts = _write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": f"Tell me about {t}."}]} for t in TOPICS[:3]])

    # prepare: every conversation becomes at least one row, with loss tokens
    assert main(["prepare", str(chats), "-o", str(tmp_path / "data"), "--target", str(target), "--no-progress"]) == 0
    rows, loss = _prepared_rows(tmp_path / "data")
    assert rows >= 24 and loss > 24 * 8, (rows, loss)

    # train on the Hugging Face forward (and the packed one where it takes the family), then export
    assert _train(target, tmp_path / "data", tmp_path / "run") == 0
    if _packed_takes(model.config):
        assert _train(target, tmp_path / "data", tmp_path / "run-packed", "--target.forward", "packed") == 0
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "drafter")]) == 0
    assert (tmp_path / "drafter" / "model.safetensors").is_file()

    # eval: speculative decoding equal to plain greedy on every prompt (in float32 on a GPU too: a tiny
    # random model's near-tied logits would swap in bfloat16 where a verify's shapes differ from greedy's)
    assert main(["eval", "--target", str(target), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
                 "--max-new-tokens", "24", "--timing-repeats", "1", "--no-progress", "--dtype", "float32",
                 "-o", str(tmp_path / "eval")]) == 0
    overall = json.loads((tmp_path / "eval" / "report.json").read_text())["overall"]
    assert overall["prompts"] == 3 and overall["matches_greedy"] == 3

    # generate: the built-in engine's families answer, the others are refused in one line
    capsys.readouterr()
    asks = _write_jsonl(tmp_path / "asks.jsonl", _conversations(3))  # the assistant turns are written anew
    code = main(["generate", "--target", str(target), "--prompts", str(asks), "--output",
                 str(tmp_path / "gen.jsonl"), "--max-new-tokens", "12", "--batch-size", "2", "--no-progress"])
    if model_type in SUPPORTED_MODEL_TYPES:
        assert code == 0
        assert len((tmp_path / "gen.jsonl").read_text().splitlines()) == 3
    else:
        err = capsys.readouterr().err.strip()
        assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert "--engine http" in err
