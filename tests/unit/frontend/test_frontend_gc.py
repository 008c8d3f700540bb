"""The frontend process keeps what it loads after start-up out of the cyclic collector's scans (no network)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from components.frontend.main import load_tokenizer_and_freeze

pytestmark = pytest.mark.unit

MODEL_PATH = str(Path(__file__).resolve().parents[3] / "models" / "tiny-llama")


def test_a_loaded_tokenizer_and_what_its_import_brought_are_frozen():
    # The process kit freezes the start-up heap before any model is discovered; the tokenizer (and transformers'
    # modules, ~250k objects) came later and were walked by every full collection while serving.
    try:
        tok = load_tokenizer_and_freeze(MODEL_PATH)
        assert gc.get_freeze_count() > 0
        tracked = gc.get_objects()  # generations 0-2 only: the frozen ones are not among them
        assert not any(o is tok._hf for o in tracked)
        assert tok.encode("hello", add_special_tokens=False)  # still a working tokenizer
    finally:
        gc.unfreeze()  # the test process's heap back in the collector's reach
