"""trainer/common/startup.py's context: the collector off while a rank imports, then what exists frozen
(the e2e side, tests/e2e/test_startup.py, counts a real rank's full passes)."""

import gc

import pytest

from trainer.common import startup


def test_importing_turns_the_collector_off_then_freezes_and_turns_it_on_again_even_on_error():
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(RuntimeError), startup.importing():
            assert not gc.isenabled()
            made = [[i] for i in range(100)]  # tracked objects: frozen
            raise RuntimeError(len(made))
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + 100
    finally:
        gc.unfreeze()
        gc.enable()
