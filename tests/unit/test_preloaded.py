"""Programs run by the preloaded server (``kvoffload.impl.testing.preloaded``, started for every test session by
tests/conftest.py) end as ``python`` runs them in a process of its own: the same output, exit status and
``sys.argv``/``sys.path``, their threads and exit functions run. Each program is run both ways and compared; the
first line each prints says whether vLLM was imported before it started (the server's programs: yes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from kvoffload.impl.testing import preloaded

PREFIX = "import sys; print('vllm' in sys.modules, flush=True)\n"
PROGRAMS = {
    "argv, cwd, path": "import os; print(sys.argv, os.getcwd(), sys.path[:2], os.environ.get('WHO'))",
    "exit status": "print('leaving'); sys.exit(3)",
    "exit with a message": "sys.exit('a message, status 1')",
    "an exception": "raise ValueError('raised')",
    "killed by a signal": "import os, signal; print('dying', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
    "threads and exit functions": textwrap.dedent("""
        import atexit, threading, time
        atexit.register(lambda: print('exit function ran'))
        def late():
            time.sleep(0.2)
            print('thread ended')
        threading.Thread(target=late).start()
        print('main ended')"""),
}


def both(argv: list[str], **options) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    options = {"capture_output": True, "text": True, "timeout": 60, **options}
    return subprocess.run(argv, **options), preloaded.run(argv, **options)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_program_ends_as_in_a_process_of_its_own(name, tmp_path):
    env = {**os.environ, "WHO": "tests", "PYTHONPATH": str(tmp_path)}
    fresh, served = both([sys.executable, "-c", PREFIX + PROGRAMS[name], "an", "argument"], cwd=tmp_path, env=env)
    assert fresh.stdout.startswith("False\n") and served.stdout.startswith("True\n"), served.stderr
    assert served.returncode == fresh.returncode
    assert served.stdout.split("\n", 1)[1] == fresh.stdout.split("\n", 1)[1]
    assert served.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]


def test_a_script_and_a_module_get_the_path_python_gives_them(tmp_path):
    (tmp_path / "sibling.py").write_text("WHERE = 'beside the script'\n")
    (tmp_path / "script.py").write_text(PREFIX + "import sibling; print(sibling.WHERE, sys.argv, sys.path[0])\n")
    for argv in (["script.py", "x"], ["-m", "script", "y"]):
        fresh, served = both([sys.executable, *argv], cwd=tmp_path)
        assert served.stdout.startswith("True\n") and served.returncode == fresh.returncode == 0, served.stderr
        assert served.stdout.split("\n", 1)[1] == fresh.stdout.split("\n", 1)[1]


def test_each_program_starts_with_random_states_of_its_own(tmp_path):
    code = "import random, numpy; print(random.random(), numpy.random.random())"
    first, second = (preloaded.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in "ab")
    assert first.returncode == second.returncode == 0 and first.stdout != second.stdout


def test_pipes_a_timeout_and_a_kill(tmp_path):
    echo = "import sys\nprint('READY', flush=True)\nfor line in sys.stdin: print('GOT', line.strip(), flush=True)"
    process = preloaded.popen([sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert isinstance(process, preloaded.Process) and process.stdout.readline() == "READY\n"
    process.stdin.write("work\n")
    process.stdin.flush()
    assert process.stdout.readline() == "GOT work\n" and process.poll() is None
    process.stdin.close()
    assert process.wait(30) == 0
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    sleeper = preloaded.popen([sys.executable, "-c", "import time; time.sleep(60)"])
    sleeper.kill()
    assert sleeper.wait(30) == -signal.SIGKILL


def test_what_only_a_new_interpreter_can_give_gets_one():
    """Another hash seed (or OpenMP setting) than the server started with, or another Python (vLLM
    0.33's venv, say): a new interpreter."""
    code = PREFIX + "print(hash('kvoffload'))"
    seeds = {}
    for seed in ("1", "2"):
        done = preloaded.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.stdout.startswith("False\n"), done.stderr
        seeds[seed] = done.stdout
    assert seeds["1"] != seeds["2"]
    other = shutil.which("python3")
    assert other and other != sys.executable
    done = preloaded.run([other, "-c", PREFIX], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "False\n", done.stderr

