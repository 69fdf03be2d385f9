"""A script without an ``if __name__ == "__main__":`` guard can use the engine's child processes
(the README's snippet pasted into a file used to hang for good: the spawn child re-ran the script)."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_grammar_compiler_starts_from_a_script_without_a_main_guard(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from transformers import AutoTokenizer
        from models import EMBEDDED_MODEL_DIR
        from replicas.grammar import GrammarCompiler, GrammarSpec
        compiler = GrammarCompiler(AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR), 4096)
        compiler.compile(GrammarSpec("choice", ["yes", "no"]))
        compiler.close()
        print("compiled once")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("compiled once") == 1   # the child did not run the script again
