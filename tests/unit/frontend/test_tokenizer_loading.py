"""``load_tokenizer``: a generic fast tokenizer is loaded by its class, without ``AutoTokenizer`` and the torch import
it brings (seconds of every frontend's start-up), and gives what ``AutoTokenizer`` gives; any other goes through
``AutoTokenizer``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from components.frontend.tokenizer import load_tokenizer, tokenizer_class_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
MODEL_PATH = str(ROOT / "models" / "tiny-llama")
TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "日本語 🙂 <|bos|> mixed <|eos|>", ""]


def _load_in_a_fresh_process(path: str) -> dict[str, object]:
    code = (
        "import json, sys\n"
        "from components.frontend.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({path!r})\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'cls': type(tok._hf).__name__,"
        " 'ids': tok._hf.encode('Hello, world!')}))\n"
    )
    env = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_a_generic_fast_tokenizer_loads_without_importing_torch():
    assert tokenizer_class_name(MODEL_PATH) == "PreTrainedTokenizerFast"
    out = _load_in_a_fresh_process(MODEL_PATH)
    assert out["torch"] is False and out["cls"] == "TokenizersBackend"


def test_it_is_the_tokenizer_auto_tokenizer_gives():
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(MODEL_PATH, local_files_only=True)
    ours = load_tokenizer(MODEL_PATH)._hf
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(auto.encode(text)) == auto.decode(auto.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == auto.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_model_specific_tokenizer_class_goes_through_auto_tokenizer(tmp_path: Path):
    model = tmp_path / "model"
    shutil.copytree(MODEL_PATH, model, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "LlamaTokenizerFast"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = _load_in_a_fresh_process(str(model))
    # AutoTokenizer's path, as before: torch imported, and the model's own class, which may tokenize differently
    # from the generic one (this one does: a different class, and other ids for the same text).
    assert out["torch"] is True and out["cls"] != "TokenizersBackend"


def test_the_class_name_is_none_without_a_readable_config(tmp_path: Path):
    assert tokenizer_class_name(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert tokenizer_class_name(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text('["a list"]')
    assert tokenizer_class_name(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": 3}')
    assert tokenizer_class_name(str(tmp_path)) is None
