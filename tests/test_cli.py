"""`hf-deltamatch` prints nothing but its own output: no library-load failures or deprecation warnings from
optional dependencies before the help (`import hf_deltamatch` defers transformers until a model needs it)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"]])
def test_help_prints_only_the_help(args):
    res = subprocess.run([sys.executable, "-m", "hf_deltamatch.cli", *args], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith("usage: hf-deltamatch")


def test_import_defers_transformers_and_still_registers():
    """`import hf_deltamatch` leaves transformers unimported; the first import of its attention or mask registry
    (what every model goes through) registers deltamatch_fp8 in both, whichever comes first."""
    code = """
import sys
import hf_deltamatch
from hf_deltamatch.integrations import transformers as integration
assert "transformers" not in sys.modules, "import hf_deltamatch imported transformers"
from transformers.masking_utils import AttentionMaskInterface
from transformers import AttentionInterface
assert AttentionMaskInterface._global_mapping["deltamatch_fp8"] is integration.deltamatch_mask
assert AttentionInterface._global_mapping["deltamatch_fp8"] is integration.deltamatch_attention_forward
assert not any(type(f).__name__ == "_RegisterOnImport" for f in sys.meta_path)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
